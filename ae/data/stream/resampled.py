"""`--shard_split=resampled`: training without counting, for sets too large or too remote to count.

No shard is counted. An epoch is `--epoch_samples` samples, all ranks together, split into the
same number of full batches per rank (floor(epoch_samples / (world_size x batch_size))) and dealt
to the workers as in the even split, so every rank still runs the same number of steps. Each
(rank, worker) slot draws shards at random with replacement (seeded by the seed, the epoch, the
rank and the slot, so a resumed epoch draws the same) and reads each drawn shard from its first
sample until the slot's quota is met. Bad data is handled as in the counted modes: a bad shard is
logged and the next one drawn; the quota is topped up with good samples if need be.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from ae.data.planning.plan import EpochPlan
from ae.data.shards.errors import SlotErrors
from ae.data.shards.tar_samples import ByteCount, RawSample, TarReader, iter_samples
from ae.data.stream.worker_stats import SlotMeter

# A slot stops drawing after this many shards in a row gave it nothing (all of them broken?):
# its quota is then filled from elsewhere, or the run stops naming the split.
BARREN_DRAWS = 64


@dataclass(frozen=True)
class ResampledPlan(EpochPlan):
    """An epoch of `epoch_samples` drawn from `shards` shards; no counts."""

    epoch_samples: int = 0
    shards: int = 0
    seed: int = 0
    epoch: int = 0

    @property
    def total_samples(self) -> int:  # type: ignore[override]
        return self.epoch_samples

    def draws(self, rank: int, slot: int) -> Iterator[int]:
        """The shards slot (rank, slot) reads this epoch, in order: with replacement, forever."""
        rng = np.random.default_rng([self.seed, self.epoch, rank, slot])
        while True:
            yield from rng.integers(self.shards, size=64).tolist()


def resampled_plan(
    shards: int,
    epoch_samples: int,
    *,
    world_size: int,
    num_workers: int,
    batch_size: int,
    seed: int,
    epoch: int,
) -> ResampledPlan:
    return ResampledPlan(
        counts=(),
        world_size=world_size,
        num_workers=max(1, num_workers),
        batch_size=batch_size,
        mode="resampled",
        order=(),
        epoch_samples=epoch_samples,
        shards=shards,
        seed=seed,
        epoch=epoch,
    )


def read_resampled(
    urls: list[str],
    draws: Iterator[int],
    quota: int,
    errors: SlotErrors,
    reader: TarReader = "fast",
    meter: SlotMeter | None = None,
) -> Iterator[RawSample]:
    """Whole drawn shards, from their first sample, until `quota` samples were read. A shard
    that fails is reported (ERROR line naming it and its last good sample) and the next drawn."""
    got = barren = 0
    count: ByteCount | None = meter.count if meter else None
    for shard in draws:
        if got >= quota or barren >= BARREN_DRAWS:
            return
        url, before, last_key = urls[shard], got, None
        if meter is not None:
            meter.shard(shard)
        samples = iter_samples(url, 0, reader, count)
        try:
            for sample in samples:
                got, last_key = got + 1, sample["__key__"]
                yield sample
                if got >= quota:
                    return
        except Exception as e:  # unreadable/truncated shard, failed pipe or download
            errors.bad_shard(url, f"{type(e).__name__}: {e}", last_key, 0, got - before)
        finally:
            with contextlib.suppress(Exception):  # a pipe stopped early exits on SIGPIPE
                samples.close()
        barren = 0 if got > before else barren + 1
