"""Which samples a rank's batch held, found after the fact from the plan: the shard and key of
each, and whether its decoded array is finite (`ae.training.nonfinite` names them).

Nothing is recorded while training: the DataLoader takes batch i of an epoch from slot i % K
(`resume_arithmetic.worker_skip`), and a slot's order is its seeded shuffle of its planned
slices (`shuffle_order.shuffled_order`, as the workers draw it). So batch i holds the slot's
samples [i // K * B, i // K * B + B) of that order. The shards are then read once, for those
samples only. This is the plan's answer: a bad sample earlier in the same slot (dropped and
replaced) shifts the batches after it by one sample; a resampled split (`--shard_split=
resampled`) is not replayed (no members).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ae.data.planning.shuffle_order import shuffled_order
from ae.data.stream.resampled import ResampledPlan
from ae.data.stream.resume_arithmetic import slot_rng
from ae.data.stream.shard_stream import ShardStream
from ae.data.stream.stages import read_shard
from ae.log_lines import NONFINITE_INPUT

KEYS_SHOWN = 16  # keys named per shard in a NONFINITE line; more are counted


@dataclass(frozen=True)
class Member:
    url: str
    key: str
    finite: bool | None  # None: the sample could not be decoded


def batch_members(stream: ShardStream, batch: int) -> list[Member]:
    """The samples of the rank's batch `batch` (0-based, in the stream's current epoch), in
    their shard order; [] for a resampled split."""
    plan = stream.plan()
    if isinstance(plan, ResampledPlan):
        return []
    k = max(1, stream.num_workers)
    slot, local = batch % k, batch // k
    slices = stream._shard_slices(plan, stream.rank, slot)
    sizes = np.array([s.stop - s.start for s in slices], dtype=np.int64)
    bounds = np.concatenate([[0], np.cumsum(sizes)])
    bufsize = stream.shuffle_buffer if stream.shuffle else 0
    rng = slot_rng(stream.seed, stream.epoch, stream.rank, slot)
    order = shuffled_order(int(bounds[-1]), bufsize, rng)
    picks = order[local * stream.batch_size : (local + 1) * stream.batch_size]
    wanted: dict[int, set[int]] = {}  # shard -> sample indices in it
    for pos in picks.tolist():
        i = int(np.searchsorted(bounds, pos, side="right")) - 1
        wanted.setdefault(slices[i].shard, set()).add(slices[i].start + pos - int(bounds[i]))
    members = []
    for shard, indices in sorted(wanted.items()):
        url, first = stream.urls[shard], min(indices)
        samples = read_shard(url, first, max(indices) + 1, stream.tar_reader)
        for i, sample in enumerate(samples, start=first):
            if i in indices:
                members.append(Member(url, sample["__key__"], _finite(stream, sample)))
    return members


def _finite(stream: ShardStream, sample: dict) -> bool | None:
    try:
        array = stream.decoder.decode(sample, None)
    except Exception:  # a bad sample: its ERROR line was written when it was read
        return None
    return bool(np.isfinite(array).all())


def describe_members(members: list[Member]) -> str:
    """`shard a.tar, keys [k1, k2]; shard b.tar, keys [...]`: the samples with non-finite input
    alone when there are any (marked), else all the batch's."""
    bad = [m for m in members if m.finite is False]
    shown, note = (bad, f" {NONFINITE_INPUT}") if bad else (members, "")
    if not shown:
        return "samples unknown (resampled split)"
    by_url: dict[str, list[str]] = {}
    for m in shown:
        by_url.setdefault(m.url, []).append(m.key)
    parts = []
    for url, keys in by_url.items():
        more = f", ... {len(keys) - KEYS_SHOWN} more" if len(keys) > KEYS_SHOWN else ""
        parts.append(f"shard {url}, keys [{', '.join(keys[:KEYS_SHOWN])}{more}]{note}")
    return "; ".join(parts)
