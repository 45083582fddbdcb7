"""The even split: which samples each (rank, worker) slot reads in an epoch.

Whole-shard assignment (what WebDataset does) gives ranks different batch counts, and the rank
that finishes first waits forever in an all-reduce. Here the split is at sample level:

1. Shards are put in a per-(seed, epoch) random order and their samples concatenated into one
   virtual sequence of T samples.
2. Every rank gets the same number of *full* batches: floor(T / (W*B)) in `drop` mode (fewer
   than W*B samples dropped), ceil(T / (W*B)) in `pad` mode (the sequence wraps around, repeats
   logged).
3. A rank's batches are dealt to its K workers as evenly as possible; each slot (rank, worker)
   reads one contiguous range of the sequence, so it touches few shards and skips within at most
   one. Slots are laid out worker-major across ranks (slot = rank*K + worker).

Memory is O(#shards): a slot's shard slices are computed on demand from cumulative counts.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Literal

import numpy as np

SplitMode = Literal["drop", "pad", "resampled"]  # resampled: ae.data.resampled


@dataclass(frozen=True)
class ShardSlice:
    """Samples [start, stop) of shard number `shard` (index into the shard list)."""

    shard: int
    start: int
    stop: int


@dataclass(frozen=True)
class EpochPlan:
    counts: tuple[int, ...]
    world_size: int
    num_workers: int  # K >= 1 (0 dataloader workers means one in-process slot)
    batch_size: int
    mode: SplitMode
    order: tuple[int, ...]  # shard visiting order for this epoch

    @functools.cached_property
    def total_samples(self) -> int:
        return sum(self.counts)

    @property
    def batches_per_rank(self) -> int:
        per_round = self.world_size * self.batch_size
        if self.mode == "pad":
            return -(-self.total_samples // per_round)
        return self.total_samples // per_round

    @property
    def samples_per_rank(self) -> int:
        return self.batches_per_rank * self.batch_size

    @property
    def dropped(self) -> int:
        return max(0, self.total_samples - self.world_size * self.samples_per_rank)

    @property
    def repeated(self) -> int:
        return max(0, self.world_size * self.samples_per_rank - self.total_samples)

    def worker_batches(self, worker: int) -> int:
        q, r = divmod(self.batches_per_rank, self.num_workers)
        return q + (worker < r)

    def slot_range(self, rank: int, worker: int) -> tuple[int, int]:
        """[begin, end) positions in the epoch's virtual sample sequence (end may wrap past T)."""
        begin = (
            rank * self.samples_per_rank
            + sum(self.worker_batches(w) for w in range(worker)) * self.batch_size
        )
        return begin, begin + self.worker_batches(worker) * self.batch_size

    @functools.cached_property
    def _starts(self) -> np.ndarray:
        """Where each shard (in this epoch's order) starts in the virtual sequence; T at the end.
        Computed once per plan: O(#shards) memory, and every slot lookup is a binary search."""
        ordered = np.asarray(self.counts, dtype=np.int64)[np.asarray(self.order, dtype=np.int64)]
        return np.concatenate([[0], np.cumsum(ordered)])

    def slot_slices(self, rank: int, worker: int) -> list[ShardSlice]:
        """The shard slices a slot reads, in order; positions past T wrap (pad mode)."""
        begin, end = self.slot_range(rank, worker)
        total = self.total_samples
        starts = self._starts
        slices: list[ShardSlice] = []
        pos = begin
        while pos < end:
            p = pos % total
            j = int(np.searchsorted(starts, p, side="right")) - 1
            take = min(end - pos, int(starts[j + 1]) - p)
            local = p - int(starts[j])
            slices.append(ShardSlice(self.order[j], local, local + take))
            pos += take
        return slices


def plan_epoch(
    counts: list[int] | tuple[int, ...],
    *,
    world_size: int,
    num_workers: int,
    batch_size: int,
    mode: SplitMode = "drop",
    seed: int = 0,
    epoch: int = 0,
    shuffle: bool = True,
) -> EpochPlan:
    order = list(range(len(counts)))
    if shuffle:
        order = np.random.default_rng([seed, epoch]).permutation(len(counts)).tolist()
    return EpochPlan(
        counts=tuple(int(c) for c in counts),
        world_size=world_size,
        num_workers=max(1, num_workers),
        batch_size=batch_size,
        mode=mode,
        order=tuple(order),
    )


def assign_shards(counts: list[int] | tuple[int, ...], world_size: int) -> list[list[int]]:
    """Whole shards to ranks, for work that must see every sample exactly once (`ae-encode`,
    which writes one output shard per input shard): the largest shard first, each to the rank
    with the fewest samples so far (ties: the lowest rank), so ranks differ by at most one
    shard's samples. Each rank's shards are in index order. The same on every rank."""
    loads = [0] * world_size
    ranks: list[list[int]] = [[] for _ in range(world_size)]
    for shard in sorted(range(len(counts)), key=lambda i: (-counts[i], i)):
        rank = min(range(world_size), key=lambda r: (loads[r], r))
        ranks[rank].append(shard)
        loads[rank] += counts[shard]
    return [sorted(shards) for shards in ranks]
