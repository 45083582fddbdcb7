"""The per-rank stream of batches: an IterableDataset whose workers read their planned slices.

Each dataloader worker (or the rank itself with 0 workers) is one slot of the epoch's plan
(`ae.data.planning.plan`). Its pipeline is the chain of generator stages in
`ae.data.stream.stages` (read, shuffle, skip on resume, decode, fill, batch): the general path.
Where every shard of the slot has one fixed layout (`.npy` vectors laid out alike:
`ae.data.stream.fixed_layout_batches`), the slot takes that path instead: the same samples in
the same order, each batch one gather from the memory-mapped shards (`columnar_slot`, the one
place the path is picked).

Decoding is the run's `SampleDecoder` (`ae.data.decoding.decode`); in training, an image's
random crop and flip are a hash of (seed, epoch, shard, key), so a resumed epoch crops each
sample as the first run did. Workers build whole batches, so the DataLoader runs with
`batch_size=None`. Which batches a resumed epoch skips: `ae.data.stream.resume_arithmetic`.
"""

from __future__ import annotations

import contextlib
import itertools
import random
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import torch
from loguru import logger
from torch.utils.data import IterableDataset, get_worker_info

from ae.data.decoding.decode import Augment, InputSpec, SampleDecoder
from ae.data.planning.plan import EpochPlan, ShardSlice, SplitMode, plan_epoch
from ae.data.planning.shuffle_order import shuffled_order
from ae.data.shards.errors import DataError, ErrorCounts, SlotErrors
from ae.data.shards.spec import is_remote
from ae.data.shards.tar_samples import RawSample, TarReader
from ae.data.stream.batch_buffers import WorkerBuffers
from ae.data.stream.fixed_layout_batches import column_batches, columnar_slot
from ae.data.stream.loader import into_shared_memory
from ae.data.stream.resampled import ResampledPlan, read_resampled, resampled_plan
from ae.data.stream.resume_arithmetic import resumed_slot, slot_rng, worker_skip
from ae.data.stream.stages import (
    REPLACEMENT_POOL,
    batch_encoded,
    batch_samples,
    decode_samples,
    fill_quota,
    read_shard,
    read_slices,
    shuffle_samples,
)
from ae.data.stream.worker_stats import SlotMeter, WorkerStats
from ae.forensics.faults import fault_point
from ae.log_lines import COMPLETED_ITERATION, PROCESSING_FILES
from logging_cfg import log_worker_exceptions

_POSITION = {"epoch": 0, "skip_batches": 1, "resumed": 2}  # ShardStream.position's fields


def _last_problem(failed: tuple[str, str] | None) -> str:
    """`; last problem: URL: Type: message` for the no-readable-sample error, and what to do
    when the shard is remote (all of them failing at once: their source stopped answering)."""
    if failed is None:
        return ""
    url, reason = failed
    said = f"; last problem: {url}: {reason}"
    if is_remote(url):
        said += "; once the shards' source answers again, --resume_from_checkpoint=last goes on"
    return said


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
    # whole-batch gathers where the shards allow (`ae.data.stream.fixed_layout_batches`)
    columnar: bool = True
    seed: int = 0
    debug: bool = False
    epoch: int = 0
    skip_batches: int = 0  # a resumed epoch starts after this many of the rank's batches
    # The rest of an epoch resumed with other settings (`ae.data.stream.resume`): the intervals of
    # the epoch's sequence not yet trained on, which the epoch `epoch` splits while `resumed`.
    base: tuple[tuple[int, int], ...] | None = None
    base_seed: int = 0  # the seed of the shard order `base` refers to (the checkpoint's)
    resumed: bool = False
    epoch_samples: int = 0  # mode "resampled": samples per epoch, all ranks together
    augment: bool = False  # random crops (and flips, if the decoder has them): training only
    # The stretches of the shards this split reads (`ae.data.planning.holdout`: validation held out
    # of the train shards); empty: every sample of every shard. The plan deals stretches as shards.
    parts: tuple[ShardSlice, ...] = ()
    errors: ErrorCounts = field(init=False)
    stats: WorkerStats = field(init=False)
    # (epoch, skip_batches, resumed) as the rank last set them, in shared memory: persistent
    # workers hold the copy of the stream they were started with, and read these at every epoch
    position: torch.Tensor = field(init=False)
    # Set by the train loader before its workers fork (`ae.data.stream.batch_buffers`): which
    # batches the rank has let go of, so that each worker reuses its shared-memory buffers.
    released: torch.Tensor | None = field(default=None, init=False)

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

    @property
    def reuses_buffers(self) -> bool:
        """Whether its workers can hand batches over in reused buffers: not batches of JPEG
        bytes for the GPU, whose size changes from batch to batch."""
        return not self.decoder.gpu_jpeg

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
        (`ae.data.planning.holdout`), else the shards' counts. Resume reckons in the same units."""
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

    def repeats_in(self, batch: int) -> int:
        """How many samples of the rank's batch `batch` (0-based, this epoch) repeat one of the
        epoch's to fill it: in pad mode, the batch's last ones where the split is not shuffled
        (validation); 0 in the other modes. The DataLoader takes batch i from slot i % K
        (`ae.data.stream.batch_members`)."""
        if self.mode != "pad":
            return 0
        k = max(1, self.num_workers)
        return self.plan().repeats_in_batch(self.rank, batch % k, batch // k)

    def _fallback_pool(self, slot: int, own: set[int], errors: SlotErrors) -> list[np.ndarray]:
        """Good samples from the shards outside this slot's, for a slot whose shards gave none.
        Their errors are not reported again here: they belong to the slots that own them."""
        pool: list[np.ndarray] = []
        failed = errors.last_shard  # the last shard that failed, and how: said if none is left
        for part in self._whole():
            if part.shard in own:
                continue
            url = self.urls[part.shard]
            try:
                for sample in read_shard(url, part.start, part.stop, self.tar_reader):
                    with contextlib.suppress(Exception):
                        pool.append(self.decoder.decode(sample, self._augment()))
                    if len(pool) == REPLACEMENT_POOL:
                        return pool
            except Exception as e:
                failed = (url, f"{type(e).__name__}: {e}")
        if pool:
            return pool
        error = DataError(
            f"{self.split}_shards: no readable sample in any of {len(self.urls)} shards "
            f"(rank {self.rank} slot {slot} has nothing to train on){_last_problem(failed)}"
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
        decoder = replace(self.decoder, gpu_jpeg=False)  # pixels here, not bytes for the GPU
        return list(itertools.islice(decode_samples(raw, decoder, errors), n))

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
            lambda: self._fallback_pool(slot, own, errors),
            errors,
        )
        batch = batch_encoded if self.decoder.gpu_jpeg else batch_samples
        return batch(stream, self.batch_size, self.spec)

    def _hand_over(self, info: Any) -> Callable[[Any], Any]:
        """How a batch leaves this process: as it is in the rank's own process; in a worker, in
        shared memory (`into_shared_memory` tells the two apart), in one of the worker's reused
        buffers with its tag when the loader asked for them (`released`). The buffers last the
        epoch: between epochs (validation) a worker holds none, as before."""
        if info is None or self.released is None:
            return into_shared_memory
        return WorkerBuffers(info.id, self.released).hand_over

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
        hand_over = self._hand_over(info)
        for i, batch in enumerate(batches):
            fault_point("data", step0 + i * stride)
            item = hand_over(batch)
            meter.batch(time.perf_counter() - started)
            n += len(batch)
            yield item
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
