"""The per-rank stream of batches: an IterableDataset whose workers read their planned slices.

Each dataloader worker (or the rank itself with 0 workers) is one slot of the epoch's plan
(`ae.data.plan`). Its pipeline is a chain of plain generator stages, WebDataset style:

    read_slices -> shuffle_samples -> (skip, on mid-epoch resume) -> decode_samples
        -> fill_quota -> batch_samples

That is the general path. Where every shard of the slot has one columnar layout (`.npy` vectors
laid out alike: `ae.data.columnar`), the slot takes the columnar path instead: the same samples
in the same order, each batch one gather from the memory-mapped shards (`columnar_slot`, the one
place the path is picked).

The shuffle buffer holds raw (encoded) samples: smaller than decoded arrays, and a resumed epoch
can drop the samples it already trained on without decoding them (`ae.data.resume`). Decoding is
the run's `SampleDecoder` (`ae.data.decode`); in training, an image's random crop and flip are a
hash of (seed, epoch, shard, key), so a resumed epoch crops each sample as the first run did.

Bad data is handled by the stages, not the tar parser: `read_slices` logs a shard that cannot be
opened or ends early, `decode_samples` a sample that fails to decode or has the wrong shape (both
at ERROR, naming shard and sample key) and drops it; `fill_quota` then tops the slot up to its
planned count by repeating good samples of the slot (a seeded reservoir of at most
`REPLACEMENT_POOL`), so every rank still yields exactly `plan.batches_per_rank` full batches and
no rank is left waiting in an all-reduce. Workers build whole batches, so the DataLoader runs
with `batch_size=None`.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import random
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, TypeVar

import numpy as np
import torch
from loguru import logger
from torch.utils.data import IterableDataset, get_worker_info

from ae.data.columnar import column_batches, columnar_slot
from ae.data.decode import Augment, InputSpec, SampleDecoder
from ae.data.errors import DataError, ErrorCounts, SlotErrors
from ae.data.index import sample_offset
from ae.data.loader import into_shared_memory
from ae.data.plan import EpochPlan, ShardSlice, SplitMode, plan_epoch
from ae.data.resampled import ResampledPlan, read_resampled, resampled_plan
from ae.data.shuffle_order import shuffled_order
from ae.data.tar_samples import ByteCount, RawSample, TarReader, iter_samples
from ae.data.worker_stats import SlotMeter, WorkerStats
from ae.forensics.faults import fault_point
from ae.log_lines import COMPLETED_ITERATION, PROCESSING_FILES
from logging_cfg import log_worker_exceptions

# Replacements for bad samples cycle through a reservoir sample of this many good samples of the
# slot: enough variety for a few bad samples, bounded memory for a whole bad shard.
REPLACEMENT_POOL = 64

T = TypeVar("T")
_POSITION = {"epoch": 0, "skip_batches": 1, "resumed": 2}  # ShardStream.position's fields


def read_shard(
    url: str, start: int, stop: int, reader: TarReader = "fast", count: ByteCount | None = None
) -> Iterator[RawSample]:
    """Samples [start, stop) of one shard. A local shard with an index is entered by seeking to
    sample `start`; others are read from the top and the first `start` samples skipped.
    `count`: adds the bytes read."""
    offset = sample_offset(url, start)
    skip = start if offset is None else 0
    samples = iter_samples(url, offset or 0, reader, count)
    try:
        yield from itertools.islice(samples, skip, skip + stop - start)
    finally:
        # Stopping before a pipe's end makes its command exit on SIGPIPE, which gopen reports
        # as an error on close; the samples asked for were all read, so it is no error here.
        with contextlib.suppress(Exception):
            samples.close()


def read_slices(
    urls: list[str],
    slices: list[ShardSlice],
    errors: SlotErrors,
    debug: bool = False,
    reader: TarReader = "fast",
    meter: SlotMeter | None = None,
) -> Iterator[RawSample]:
    """Each slice's samples in order. A shard that fails, or ends before the slice does, is
    reported (ERROR line naming it and the last good sample) and the next slice read. `meter`
    is told which shard is read and counts its bytes."""
    for s in slices:
        url, want, got, last_key = urls[s.shard], s.stop - s.start, 0, None
        t0 = time.perf_counter()
        if meter is not None:
            meter.shard(s.shard)
        samples = read_shard(url, s.start, s.stop, reader, meter.count if meter else None)
        reason = None
        try:
            for sample in samples:
                got, last_key = got + 1, sample["__key__"]
                yield sample
        except Exception as e:  # unreadable/truncated shard, failed pipe or download
            reason = f"{type(e).__name__}: {e}"
        finally:
            samples.close()
        if reason is None and got < want:
            reason = "shard ended early: truncated, or its index or cached count is out of date"
        if reason is not None:
            errors.bad_shard(url, reason, last_key, want - got, want)
        elif debug:
            logger.debug(
                f"Shard {url}: samples [{s.start}, {s.stop}) in {time.perf_counter() - t0:.2f}s"
            )


def decode_samples(
    samples: Iterable[RawSample],
    decoder: SampleDecoder,
    errors: SlotErrors,
    augment: Augment | None = None,
) -> Iterator[np.ndarray]:
    """Decode (and check the shape); a bad sample is reported (ERROR line) and dropped.
    `augment`: training's random crops and flips; None: center crops."""
    for sample in samples:
        try:
            array = decoder.decode(sample, augment)
        except Exception as e:  # decoders raise anything on bad bytes: it is the sample's fault
            errors.bad_sample(sample.get("__url__", "?"), sample["__key__"], str(e))
            continue
        yield array


def _reservoir_weight(rng: random.Random, k: int) -> float:
    return math.exp(math.log(1.0 - rng.random()) / k)  # 1 - random() is in (0, 1]


def _reservoir_skip(rng: random.Random, w: float) -> int:
    return int(math.log(1.0 - rng.random()) / math.log(max(1.0 - w, 1e-300)))


def fill_quota(
    items: Iterable[np.ndarray],
    quota: int,
    rng: random.Random,
    fallback: Callable[[], list[np.ndarray]],
    errors: SlotErrors,
) -> Iterator[np.ndarray]:
    """Pass `items` through, then repeat good samples until `quota` were yielded. Replacements
    cycle through a reservoir sample of the slot's good samples; a slot that got none takes its
    pool from `fallback()` (good samples of other shards)."""
    pool: list[np.ndarray] = []
    n = 0
    k = REPLACEMENT_POOL
    # Reservoir sampling with geometric skips (Li's Algorithm L): a few random draws per pool
    # replacement instead of one per sample, which mattered at 100k+ samples/s.
    w = next_pick = 0.0
    for item in items:
        if n < k:
            pool.append(item)
            if n == k - 1:
                w = _reservoir_weight(rng, k)
                next_pick = n + 1 + _reservoir_skip(rng, w)
        elif n == next_pick:
            pool[rng.randrange(k)] = item
            w *= _reservoir_weight(rng, k)
            next_pick = n + 1 + _reservoir_skip(rng, w)
        n += 1
        yield item
    missing = quota - n
    if missing <= 0:
        return
    if not pool:
        pool = fallback()
    errors.replaced(missing)
    for i in range(missing):
        yield pool[i % len(pool)]


def shuffle_samples(items: Iterable[T], bufsize: int, rng: random.Random) -> Iterator[T]:
    """Reservoir-style shuffle buffer: yields a random element of the last `bufsize` seen."""
    if bufsize <= 1:
        yield from items
        return
    buf: list[T] = []
    for item in items:
        if len(buf) < bufsize:
            buf.append(item)
            continue
        i = int(rng.random() * bufsize)  # randrange() costs 3x as much, per sample
        buf[i], item = item, buf[i]
        yield item
    rng.shuffle(buf)
    yield from buf


def batch_samples(items: Iterable[np.ndarray], batch_size: int, spec: InputSpec) -> Iterator:
    """Stack samples into preallocated float32 batches; a trailing partial batch is not yielded
    (the plan hands every slot a multiple of `batch_size`, so there is none)."""
    out = np.empty((batch_size, *spec.shape), dtype=np.float32)
    i = 0
    for item in items:
        out[i] = item
        i += 1
        if i == batch_size:
            yield torch.from_numpy(out)
            out = np.empty_like(out)
            i = 0


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


@dataclass
class ShardStream(IterableDataset):
    """Batches of one split for one rank; `epoch` selects the shuffle and the plan."""

    split: str  # "train" / "val": names the shard key in log lines
    urls: list[str]
    counts: list[int]
    decoder: SampleDecoder
    batch_size: int
    rank: int
    world_size: int
    num_workers: int
    mode: SplitMode = "drop"
    shuffle: bool = True
    shuffle_buffer: int = 1000
    tar_reader: TarReader = "fast"
    columnar: bool = True  # whole-batch gathers where the shards allow (`ae.data.columnar`)
    seed: int = 0
    debug: bool = False
    epoch: int = 0
    skip_batches: int = 0  # a resumed epoch starts after this many of the rank's batches
    # The rest of an epoch resumed with other settings (`ae.data.resume`): the intervals of
    # the epoch's sequence not yet trained on, which the epoch `epoch` splits while `resumed`.
    base: tuple[tuple[int, int], ...] | None = None
    base_seed: int = 0  # the seed of the shard order `base` refers to (the checkpoint's)
    resumed: bool = False
    epoch_samples: int = 0  # mode "resampled": samples per epoch, all ranks together
    augment: bool = False  # random crops (and flips, if the decoder has them): training only
    # The stretches of the shards this split reads (`ae.data.holdout`: validation held out of
    # the train shards); empty: every sample of every shard. The plan deals stretches as shards.
    parts: tuple[ShardSlice, ...] = ()
    errors: ErrorCounts = field(init=False)
    stats: WorkerStats = field(init=False)
    # (epoch, skip_batches, resumed) as the rank last set them, in shared memory: persistent
    # workers hold the copy of the stream they were started with, and read these at every epoch
    position: torch.Tensor = field(init=False)

    def __post_init__(self) -> None:
        self.errors = ErrorCounts.create(self.num_workers)
        self.stats = WorkerStats.create(self.num_workers)
        self.position = torch.tensor(
            [self.epoch, self.skip_batches, int(self.resumed)]
        ).share_memory_()

    def __setattr__(self, name: str, value: Any) -> None:
        super().__setattr__(name, value)
        if name in _POSITION and "position" in self.__dict__:
            self.position[_POSITION[name]] = value  # seen by the workers, persistent ones too

    def worker_rates(self) -> list[dict[str, Any]]:
        """Each worker's current shard, read rate and time per batch (heartbeat)."""
        return self.stats.rows(self.urls)

    @property
    def spec(self) -> InputSpec:
        return self.decoder.spec

    def _augment(self) -> Augment | None:
        return Augment(self.seed, self.epoch) if self.augment else None

    def plan(self) -> EpochPlan:
        common: dict[str, Any] = {
            "world_size": self.world_size,
            "num_workers": self.num_workers,
            "batch_size": self.batch_size,
            "seed": self.seed,
            "epoch": self.epoch,
        }
        base = self.base if self.resumed else None
        if self.mode == "resampled":  # resumed: what the epoch has left, drawn anew
            samples = self.epoch_samples if base is None else sum(b - a for a, b in base)
            return resampled_plan(len(self.urls), samples, **common)
        if base is not None:
            common["seed"] = self.base_seed  # the plan's seed orders the shards, nothing else
        return plan_epoch(
            self.plan_counts, mode=self.mode, shuffle=self.shuffle, base=base, **common
        )

    @property
    def plan_counts(self) -> list[int]:
        """What the plan splits: the stretches' lengths when this split holds parts of shards
        (`ae.data.holdout`), else the shards' counts. Resume reckons in the same units."""
        return [p.stop - p.start for p in self.parts] if self.parts else list(self.counts)

    def _shard_slices(self, plan: EpochPlan, rank: int, slot: int) -> list[ShardSlice]:
        """The slot's slices as samples of the shards themselves (the plan counts in stretches)."""
        slices = plan.slot_slices(rank, slot)
        if not self.parts:
            return slices
        return [
            ShardSlice(p.shard, p.start + s.start, p.start + s.stop)
            for s in slices
            for p in (self.parts[s.shard],)
        ]

    def _whole(self) -> list[ShardSlice]:
        """Everything this split reads, in the plan's order (none for a resampled one)."""
        order = self.plan().order
        if self.parts:
            return [self.parts[i] for i in order]
        return [ShardSlice(i, 0, self.counts[i]) for i in order]

    def __len__(self) -> int:
        return self.plan().batches_per_rank

    def _fallback_pool(self, slot: int, own: set[int]) -> list[np.ndarray]:
        """Good samples from the shards outside this slot's, for a slot whose shards gave none.
        Their errors are not reported again here: they belong to the slots that own them."""
        pool: list[np.ndarray] = []
        for part in self._whole():
            if part.shard in own:
                continue
            with contextlib.suppress(Exception):
                url = self.urls[part.shard]
                for sample in read_shard(url, part.start, part.stop, self.tar_reader):
                    with contextlib.suppress(Exception):
                        pool.append(self.decoder.decode(sample, self._augment()))
                    if len(pool) == REPLACEMENT_POOL:
                        return pool
        if pool:
            return pool
        error = DataError(
            f"{self.split}_shards: no readable sample in any of {len(self.urls)} shards "
            f"(rank {self.rank} slot {slot} has nothing to train on)"
        )
        logger.error(str(error))  # from the worker itself, before torch wraps it
        raise error

    def first_samples(self, rank: int, n: int) -> list[np.ndarray]:
        """Up to `n` decoded samples from the start of `rank`'s first slot, read here in the
        calling process through this stream's own reader (reconstruction grids use them). Bad
        data is skipped; it is counted in a table of its own, not this stream's (the workers
        that own the slot report it)."""
        errors = SlotErrors(ErrorCounts.create(1), 0)
        raw, _, _ = self._slot_samples(self.plan(), rank, 0, errors, None, debug=False)
        return list(itertools.islice(decode_samples(raw, self.decoder, errors), n))

    def _slot_samples(
        self,
        plan: EpochPlan,
        rank: int,
        slot: int,
        errors: SlotErrors,
        meter: SlotMeter | None,
        debug: bool,
    ) -> tuple[Iterator[RawSample], int, set[int]]:
        """(the slot's raw samples, how many are planned, the shards it owns)."""
        if isinstance(plan, ResampledPlan):
            quota = plan.worker_batches(slot) * self.batch_size
            draws = plan.draws(rank, slot)
            raw = read_resampled(self.urls, draws, quota, errors, self.tar_reader, meter)
            return raw, quota, set()
        slices = self._shard_slices(plan, rank, slot)
        planned = sum(s.stop - s.start for s in slices)
        raw = read_slices(self.urls, slices, errors, debug, self.tar_reader, meter)
        return raw, planned, {s.shard for s in slices}

    def _general_batches(
        self,
        raw: Iterator[RawSample],
        planned: int,
        own: set[int],
        slot: int,
        rng: random.Random,
        skip: int,
        errors: SlotErrors,
    ) -> Iterator[torch.Tensor]:
        """The slot's batches sample by sample: shuffle, skip, decode, fill, batch."""
        if self.shuffle:
            raw = shuffle_samples(raw, self.shuffle_buffer, rng)
        if skip:
            raw = itertools.islice(raw, skip, None)
        # After a resume the quota is what is left. Bad samples among the skipped ones were
        # dropped, not counted, in the first run, so the resumed stream may repeat a few samples
        # of it; the number of batches stays exact.
        stream = fill_quota(
            decode_samples(raw, self.decoder, errors, self._augment()),
            planned - skip,
            random.Random(f"pool/{self.seed}/{self.epoch}/{self.rank}/{slot}"),
            lambda: self._fallback_pool(slot, own),
            errors,
        )
        return batch_samples(stream, self.batch_size, self.spec)

    @log_worker_exceptions
    def __iter__(self) -> Iterator[torch.Tensor]:
        info = get_worker_info()
        worker = 0 if info is None else info.id
        if info is not None:  # a worker, maybe a persistent one: the rank's epoch and skip
            epoch, skip, resumed = (int(v) for v in self.position.tolist())
            self.epoch, self.skip_batches, self.resumed = epoch, skip, bool(resumed)
        slot = resumed_slot(self.skip_batches, self.num_workers, worker)
        plan = self.plan()
        errors = SlotErrors(self.errors, worker)  # one row per worker process
        meter = self.stats.meter(worker)
        raw, planned, own = self._slot_samples(plan, self.rank, slot, errors, meter, self.debug)
        logger.info(
            PROCESSING_FILES.format(
                n=len(own) or len(self.urls),  # resampled: draws from every shard
                total=len(self.urls),
                split=self.split,
                samples=planned,
                epoch=self.epoch,
            )
        )
        errors0, replaced0 = errors.snapshot()
        rng = slot_rng(self.seed, self.epoch, self.rank, slot)
        skip = worker_skip(self.skip_batches, self.num_workers, slot) * self.batch_size
        if skip:
            logger.info(f"Skipping {skip} samples already trained on (epoch {self.epoch})")
        # The path of the slot's shards: whole-batch gathers where their layout allows it
        # (counted slices only: resampled draws take the general path).
        columns = None
        if self.columnar and self.tar_reader == "fast" and not isinstance(plan, ResampledPlan):
            slices = self._shard_slices(plan, self.rank, slot)
            columns = columnar_slot(self.urls, self.counts, slices, self.decoder, self.debug)
        if columns is not None:
            bufsize = self.shuffle_buffer if self.shuffle else 0
            order = shuffled_order(len(columns), bufsize, rng)[skip:]
            shards = [s.shard for s in slices]
            batches = column_batches(
                columns, order, self.batch_size, meter.count, lambda i: meter.reading(shards[i])
            )
        else:
            batches = self._general_batches(raw, planned, own, slot, rng, skip, errors)
        n = 0
        # The rank's batch index in the run, as the DataLoader takes batches round-robin.
        step0, stride = self.epoch * plan.batches_per_rank + worker, max(1, self.num_workers)
        # Time producing each batch, without the time suspended at `yield` (the batch waiting
        # in the loader's queue): the worker's read rate, not the rank's pace.
        started = time.perf_counter()
        for i, batch in enumerate(batches):
            fault_point("data", step0 + i * stride)
            into_shared_memory(batch)
            meter.batch(time.perf_counter() - started)
            n += len(batch)
            yield batch
            started = time.perf_counter()
        errors1, replaced1 = errors.snapshot()
        logger.info(
            COMPLETED_ITERATION.format(
                samples=n,
                split=self.split,
                epoch=self.epoch,
                errors=errors1 - errors0,
                replaced=replaced1 - replaced0,
            )
        )
