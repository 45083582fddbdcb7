"""Validation held out of the train shards, for a run given `--train_shards` and no `--val_shards`.

The held-out samples are fixed by the shard list, the counts, the fraction and `min_samples` alone
(no seed, no epoch), so every rank, every epoch and every resumed run hold out the same ones, and
train and validation never share a sample (they are disjoint stretches of the same shards):

- **by shard** when there are at least 1/`fraction` shards (100 at the default 1%): about every
  (1/`fraction`)-th shard, spread over the list, is validation whole (a few more where the
  spread shards hold fewer than the share). Validation then reads a few
  whole shards, which streams well from remote storage.
- **by sample** otherwise (one shard works too): each shard gives validation its share of the
  held-out samples, as up to `STRETCHES` short stretches spread over the shard (a folder of photos
  sorted by name is not validated on its last folder only).

Either way validation holds at least `min_samples` and the train split keeps the rest: one batch
per rank of the run that first held out, which a resumed run takes from its checkpoint rather than
from its own batch size and ranks (`ae.data.split_streams`, which plans each split over its
stretches).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from ae.data.planning.plan import ShardSlice

# Stretches per shard in a by-sample split: enough to spread validation over a sorted shard,
# few enough that a shard read from the top (no index) is read a handful of times, not per sample.
STRETCHES = 8


@dataclass(frozen=True)
class Holdout:
    """The two splits of the train shards, each a list of shard stretches in shard order."""

    train: tuple[ShardSlice, ...]
    val: tuple[ShardSlice, ...]
    by: Literal["shard", "sample"]

    @staticmethod
    def size(parts: tuple[ShardSlice, ...]) -> int:
        return sum(p.stop - p.start for p in parts)


def _spread(m: int, n: int) -> list[int]:
    """`m` of `n` indices spread evenly (the middle of each of m equal groups)."""
    return sorted({(2 * k + 1) * n // (2 * m) for k in range(m)})


def _complement(counts: list[int], val: list[ShardSlice]) -> tuple[ShardSlice, ...]:
    """Every stretch of the shards that `val` (sorted, disjoint) does not cover."""
    train: list[ShardSlice] = []
    by_shard: dict[int, list[ShardSlice]] = {}
    for part in val:
        by_shard.setdefault(part.shard, []).append(part)
    for shard, count in enumerate(counts):
        pos = 0
        for part in by_shard.get(shard, []):
            if part.start > pos:
                train.append(ShardSlice(shard, pos, part.start))
            pos = part.stop
        if count > pos:
            train.append(ShardSlice(shard, pos, count))
    return tuple(train)


def hold_out(counts: list[int], fraction: float, min_samples: int) -> Holdout:
    """Validation: max(ceil(fraction x total), min_samples) samples or a little more (whole
    shards); the caller checks that both splits can fill their batches."""
    total = sum(counts)
    want = min(total, max(math.ceil(fraction * total), min_samples))
    n = len(counts)
    if fraction * n >= 1:
        # The fewest spread shards that hold `want` (shards vary in size), up to twice the share.
        first = math.ceil(fraction * n - 1e-9)
        for m in range(first, min(n - 1, 2 * first) + 1):
            shards = _spread(m, n)
            if sum(counts[i] for i in shards) >= want:
                val = [ShardSlice(i, 0, counts[i]) for i in shards if counts[i]]
                return Holdout(_complement(counts, val), tuple(val), "shard")
    val: list[ShardSlice] = []
    before = 0
    for shard, count in enumerate(counts):
        # The shard's share, by cumulative rounding: the shares add up to `want` exactly.
        share = want * (before + count) // total - want * before // total if total else 0
        before += count
        pieces = min(share, STRETCHES)
        for j in range(pieces):
            # Stretch j: the end of the j-th of `pieces` equal sections of the shard.
            end = count * (j + 1) // pieces
            length = min(share * (j + 1) // pieces - share * j // pieces, end - count * j // pieces)
            if length:
                val.append(ShardSlice(shard, end - length, end))
    return Holdout(_complement(counts, val), tuple(val), "sample")
