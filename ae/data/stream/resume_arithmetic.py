"""The arithmetic of a resumed epoch: which batches each worker's slot yields, the shuffle
buffer's draws, and what an interrupted epoch left untrained (`ae.data.stream.resume` uses it).

The DataLoader takes batches from its workers round-robin, the plan gives the first workers the
extra batches (`EpochPlan.worker_batches`), and each slot's shuffle is a seeded draw: so the
samples the first k batches of every rank trained on follow from (plan, k, seed, epoch) alone.
"""

from __future__ import annotations

import random

import numpy as np

from ae.data.planning.plan import EpochPlan
from ae.data.planning.shuffle_order import shuffled_order


def worker_skip(skip_batches: int, num_workers: int, worker: int) -> int:
    """How many of a rank's first `skip_batches` batches come from `worker`'s slot.

    The DataLoader takes batches from its workers round-robin, and the plan gives the first
    workers the extra batches (`EpochPlan.worker_batches`), so batch i is slot i % K's."""
    k = max(1, num_workers)
    return skip_batches // k + (worker < skip_batches % k)


def slot_rng(seed: int, epoch: int, rank: int, slot: int) -> random.Random:
    """The shuffle buffer's random draws of one slot in one epoch (`shuffle_samples`)."""
    return random.Random(hash((seed, epoch, rank, slot)))


def resumed_slot(skip_batches: int, num_workers: int, worker: int) -> int:
    """The plan slot that `worker` reads when the epoch resumes after `skip_batches` batches.

    A new DataLoader iterator starts its round-robin at worker 0, but the next batch due is slot
    `skip % K`'s: rotating the worker -> slot mapping by that much keeps the order unchanged."""
    k = max(1, num_workers)
    return (worker + skip_batches) % k


def consumed(
    plan: EpochPlan, batches: int, *, shuffle_buffer: int, seed: int, epoch: int
) -> np.ndarray:
    """A mask over the plan's positions: True where a sample was trained on in the first
    `batches` batches of every rank (slot by slot: the first n samples its shuffle buffer gave
    out; `stream.shuffle_samples` and `shuffled_order` draw alike)."""
    mask = np.zeros(plan.total_samples, dtype=bool)
    for rank in range(plan.world_size):
        for slot in range(plan.num_workers):
            n = worker_skip(batches, plan.num_workers, slot) * plan.batch_size
            if n == 0:
                continue
            begin, end = plan.slot_range(rank, slot)
            rng = slot_rng(seed, epoch, rank, slot)
            order = shuffled_order(end - begin, shuffle_buffer, rng)[:n]
            mask[(begin + order) % plan.total_samples] = True
    return mask


def remainder(
    plan: EpochPlan, batches: int, *, shuffle_buffer: int, seed: int, epoch: int
) -> tuple[tuple[int, int], ...]:
    """The intervals of the epoch's sequence that `plan` covers and its first `batches` batches
    per rank did not train on, in sequence order."""
    mask = consumed(plan, batches, shuffle_buffer=shuffle_buffer, seed=seed, epoch=epoch)
    left = np.flatnonzero(~mask)
    if left.size == 0:
        return ()
    positions = plan.in_sequence(left)
    breaks = np.flatnonzero(np.diff(positions) != 1) + 1
    starts = positions[np.concatenate([[0], breaks])]
    stops = positions[np.concatenate([breaks - 1, [positions.size - 1]])] + 1
    return tuple(zip(starts.tolist(), stops.tolist(), strict=True))
