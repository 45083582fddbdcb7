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

A plan may cover only part of the epoch's sequence (`base`: intervals of it, in order): the rest
of an epoch resumed with other settings (`ae.data.stream.resume`). Steps 2 and 3 then split
that part.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Literal

import numpy as np

SplitMode = Literal["drop", "pad", "resampled"]  # resampled: ae.data.stream.resampled


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
    # [start, stop) intervals of the epoch's sequence that this plan splits (None: all of it)
    base: tuple[tuple[int, int], ...] | None = None

    @functools.cached_property
    def total_samples(self) -> int:
        if self.base is not None:
            return sum(stop - start for start, stop in self.base)
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

    def repeats_in_batch(self, rank: int, worker: int, batch: int) -> int:
        """How many of the slot's batch `batch` (0-based, in the slot's order) repeat samples of
        the sequence's start to fill it (pad mode: positions past T; the batch's last ones when
        the slot is not shuffled, as validation is not)."""
        first = self.slot_range(rank, worker)[0] + batch * self.batch_size
        return self.batch_size - min(self.batch_size, max(0, self.total_samples - first))

    @functools.cached_property
    def _starts(self) -> np.ndarray:
        """Where each shard (in this epoch's order) starts in the virtual sequence; T at the end.
        Computed once per plan: O(#shards) memory, and every slot lookup is a binary search."""
        ordered = np.asarray(self.counts, dtype=np.int64)[np.asarray(self.order, dtype=np.int64)]
        return np.concatenate([[0], np.cumsum(ordered)])

    @functools.cached_property
    def _base_starts(self) -> tuple[np.ndarray, np.ndarray]:
        """(where each base interval starts in the epoch's sequence, where it starts in the
        plan's): the plan's position p is the sequence's `first[i] + p - starts[i]`."""
        base = self.base if self.base is not None else ((0, sum(self.counts)),)
        first = np.asarray([start for start, _ in base], dtype=np.int64)
        lengths = np.asarray([stop - start for start, stop in base], dtype=np.int64)
        return first, np.concatenate([[0], np.cumsum(lengths)])

    def in_sequence(self, positions: np.ndarray) -> np.ndarray:
        """The epoch-sequence positions of plan positions (< total_samples)."""
        first, starts = self._base_starts
        i = np.searchsorted(starts, positions, side="right") - 1
        return first[i] + positions - starts[i]

    def _runs(self, begin: int, end: int) -> Iterator[tuple[int, int]]:
        """Plan positions [begin, end) as runs [a, b) of the epoch's sequence; past
        total_samples they wrap (pad mode)."""
        first, starts = self._base_starts
        total, pos = self.total_samples, begin
        while pos < end:
            p = pos % total
            i = int(np.searchsorted(starts, p, side="right")) - 1
            take = min(end - pos, int(starts[i + 1]) - p)
            a = int(first[i]) + p - int(starts[i])
            yield a, a + take
            pos += take

    def slot_slices(self, rank: int, worker: int) -> list[ShardSlice]:
        """The shard slices a slot reads, in order; positions past T wrap (pad mode)."""
        starts = self._starts
        slices: list[ShardSlice] = []
        for a, b in self._runs(*self.slot_range(rank, worker)):
            pos = a
            while pos < b:
                j = int(np.searchsorted(starts, pos, side="right")) - 1
                take = min(b - pos, int(starts[j + 1]) - pos)
                local = pos - int(starts[j])
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
    base: tuple[tuple[int, int], ...] | None = None,
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
        base=base,
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
