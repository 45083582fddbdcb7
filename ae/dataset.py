"""The per-rank stream of batches: an IterableDataset whose workers read their planned slices.

Each dataloader worker (or the rank itself with 0 workers) is one slot of the epoch's plan
(`ae.shard_plan`). Its pipeline is a chain of plain generator stages, WebDataset style:

    read_slices -> shuffle_samples -> (skip, on mid-epoch resume) -> decode_samples -> batch_samples

The shuffle buffer holds raw (encoded) samples: smaller than decoded arrays, and a resumed epoch
can drop the samples it already trained on without decoding them (`ae.data_resume`).

Workers build whole batches (one preallocated array per batch), so the DataLoader runs with
`batch_size=None` and every rank yields exactly `plan.batches_per_rank` full batches.
"""

from __future__ import annotations

import itertools
import random
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import TypeVar

import numpy as np
import torch
from loguru import logger
from torch.utils.data import IterableDataset, get_worker_info

from ae.decode import InputSpec, decode_sample
from ae.log_lines import COMPLETED_ITERATION, PROCESSING_FILES
from ae.shard_plan import EpochPlan, ShardSlice, SplitMode, plan_epoch
from ae.tar_samples import RawSample, iter_samples

T = TypeVar("T")


def read_slices(urls: list[str], slices: list[ShardSlice], debug: bool) -> Iterator[RawSample]:
    """Samples [start, stop) of each slice's shard, in order."""
    for s in slices:
        t0 = time.perf_counter()
        yield from itertools.islice(iter_samples(urls[s.shard]), s.start, s.stop)
        if debug:
            logger.debug(
                f"Shard {urls[s.shard]}: samples [{s.start}, {s.stop}) "
                f"in {time.perf_counter() - t0:.2f}s"
            )


def decode_samples(samples: Iterable[RawSample]) -> Iterator[np.ndarray]:
    for sample in samples:
        yield decode_sample(sample)


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
        i = rng.randrange(bufsize)
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
    spec: InputSpec
    batch_size: int
    rank: int
    world_size: int
    num_workers: int
    mode: SplitMode = "drop"
    shuffle: bool = True
    shuffle_buffer: int = 1000
    seed: int = 0
    debug: bool = False
    epoch: int = 0
    skip_batches: int = 0  # a resumed epoch starts after this many of the rank's batches

    def plan(self) -> EpochPlan:
        return plan_epoch(
            self.counts,
            world_size=self.world_size,
            num_workers=self.num_workers,
            batch_size=self.batch_size,
            mode=self.mode,
            seed=self.seed,
            epoch=self.epoch,
            shuffle=self.shuffle,
        )

    def __len__(self) -> int:
        return self.plan().batches_per_rank

    def __iter__(self) -> Iterator[torch.Tensor]:
        info = get_worker_info()
        worker = 0 if info is None else info.id
        worker = resumed_slot(self.skip_batches, self.num_workers, worker)
        plan = self.plan()
        slices = plan.slot_slices(self.rank, worker)
        planned = sum(s.stop - s.start for s in slices)
        files = len({s.shard for s in slices})
        logger.info(
            PROCESSING_FILES.format(
                n=files, total=len(self.urls), split=self.split, samples=planned, epoch=self.epoch
            )
        )
        rng = random.Random(hash((self.seed, self.epoch, self.rank, worker)))
        raw: Iterator[RawSample] = read_slices(self.urls, slices, self.debug)
        if self.shuffle:
            raw = shuffle_samples(raw, self.shuffle_buffer, rng)
        if skip := worker_skip(self.skip_batches, self.num_workers, worker) * self.batch_size:
            logger.info(f"Skipping {skip} samples already trained on (epoch {self.epoch})")
            raw = itertools.islice(raw, skip, None)
        n = 0
        for batch in batch_samples(decode_samples(raw), self.batch_size, self.spec):
            n += len(batch)
            yield batch
        logger.info(COMPLETED_ITERATION.format(samples=n, split=self.split, epoch=self.epoch))
