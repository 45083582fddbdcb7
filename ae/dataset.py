"""The per-rank stream of batches: an IterableDataset whose workers read their planned slices.

Each dataloader worker (or the rank itself with 0 workers) is one slot of the epoch's plan
(`ae.shard_plan`). Its pipeline is a chain of plain generator stages, WebDataset style:

    read_slices -> decode_samples -> shuffle_samples -> batch_samples

Workers build whole batches (one preallocated array per batch), so the DataLoader runs with
`batch_size=None` and every rank yields exactly `plan.batches_per_rank` full batches.
"""

from __future__ import annotations

import itertools
import random
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import numpy as np
import torch
from loguru import logger
from torch.utils.data import IterableDataset, get_worker_info

from ae.decode import InputSpec, decode_sample
from ae.fault_injection import fault_point
from ae.log_lines import COMPLETED_ITERATION, PROCESSING_FILES
from ae.shard_plan import EpochPlan, ShardSlice, SplitMode, plan_epoch
from ae.tar_samples import RawSample, iter_samples
from logging_cfg import log_worker_exceptions


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


def shuffle_samples(items: Iterable[np.ndarray], bufsize: int, rng: random.Random) -> Iterator:
    """Reservoir-style shuffle buffer: yields a random element of the last `bufsize` seen."""
    if bufsize <= 1:
        yield from items
        return
    buf: list[np.ndarray] = []
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

    @log_worker_exceptions
    def __iter__(self) -> Iterator[torch.Tensor]:
        info = get_worker_info()
        worker = 0 if info is None else info.id
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
        stream = decode_samples(read_slices(self.urls, slices, self.debug))
        if self.shuffle:
            stream = shuffle_samples(stream, self.shuffle_buffer, rng)
        n = 0
        # The rank's batch index in the run, as the DataLoader takes batches round-robin.
        step0, stride = self.epoch * plan.batches_per_rank + worker, max(1, self.num_workers)
        for i, batch in enumerate(batch_samples(stream, self.batch_size, self.spec)):
            fault_point("data", step0 + i * stride)
            n += len(batch)
            yield batch
        logger.info(COMPLETED_ITERATION.format(samples=n, split=self.split, epoch=self.epoch))
