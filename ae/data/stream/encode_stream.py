"""Every sample of whole shards, exactly once and in order: what `ae-encode` reads.

Training splits *samples* evenly across ranks and drops or repeats a few (`ae.data.planning.plan`);
encoding must see each sample once and write one output shard per input shard, so ranks get
whole shards (`assign_shards`) and a rank's dataloader workers split them again, whole: worker w
of K reads the rank's shards w, w+K, w+2K, ... Each item is a batch of one shard's samples:

    {"shard": index in the URL list, "keys": [...], "inputs": float32 (n, *shape),
     "kept": [{field: bytes}] (the fields asked for), "last": True on the shard's last batch,
     "damaged": True when the shard could not be read to its end}

A shard's last batch (possibly empty: a shard whose samples were all bad) always comes, so the
consumer knows when to close its output shard, or, for a damaged shard, to drop it. Bad samples
and unreadable or truncated shards are logged at ERROR naming the shard and key (as in
training, with the samples the plan counted that were not read), counted, and skipped.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch.utils.data import IterableDataset, get_worker_info

from ae.data.decoding.decode import InputSpec, SampleDecoder
from ae.data.shards.errors import ErrorCounts, SlotErrors
from ae.data.shards.tar_samples import TarReader, iter_samples
from ae.data.stream.loader import into_shared_memory
from ae.forensics.faults import fault_point
from logging_cfg import log_worker_exceptions

KEEP_ALL = "all"


def kept_fields(sample: dict[str, Any], keep: frozenset[str]) -> dict[str, bytes]:
    """The fields of `sample` to copy to the output: those named in `keep`, or all of them."""
    return {
        k: v
        for k, v in sample.items()
        if not k.startswith("__") and (KEEP_ALL in keep or k in keep)
    }


@dataclass
class WholeShards(IterableDataset):
    urls: list[str]
    shards: list[int]  # this rank's shards (indices into `urls`)
    decoder: SampleDecoder  # the training run's: same field, mode, size and (center) crop
    batch_size: int
    num_workers: int
    keep: frozenset[str] = frozenset()
    tar_reader: TarReader = "fast"
    planned: dict[int, int] = field(default_factory=dict)  # samples per shard, as counted
    errors: ErrorCounts = field(init=False)

    def __post_init__(self) -> None:
        self.errors = ErrorCounts.create(self.num_workers)

    @property
    def spec(self) -> InputSpec:
        return self.decoder.spec

    def _batch(
        self,
        shard: int,
        keys: list[str],
        arrays: list[np.ndarray],
        kept: list,
        last: bool,
        damaged: bool = False,
    ) -> dict[str, Any]:
        inputs = np.stack(arrays) if arrays else np.empty((0, *self.spec.shape), np.float32)
        return {
            "shard": shard,
            "keys": keys,
            "inputs": torch.from_numpy(inputs),
            "kept": kept,
            "last": last,
            "damaged": damaged,
        }

    def _shard_batches(self, shard: int, errors: SlotErrors) -> Iterator[dict[str, Any]]:
        url = self.urls[shard]
        keys: list[str] = []
        arrays: list[np.ndarray] = []
        kept: list[dict[str, bytes]] = []
        last_key, n, damaged = None, 0, False
        samples = iter_samples(url, reader=self.tar_reader)
        try:
            for sample in samples:
                last_key, n = sample["__key__"], n + 1
                try:
                    array = self.decoder.decode(sample)  # checks the shape too
                except Exception as e:  # decoders raise anything on bad bytes
                    errors.bad_sample(url, sample["__key__"], str(e))
                    continue
                keys.append(sample["__key__"])
                arrays.append(array)
                kept.append(kept_fields(sample, self.keep))
                if len(arrays) == self.batch_size:
                    yield self._batch(shard, keys, arrays, kept, last=False)
                    keys, arrays, kept = [], [], []
        except Exception as e:  # unreadable or truncated shard: its output is dropped
            planned = self.planned.get(shard, n)
            lost = max(0, planned - n)
            errors.bad_shard(url, f"{type(e).__name__}: {e}", last_key, lost, planned)
            damaged = True
        finally:
            with contextlib.suppress(Exception):
                samples.close()
        yield self._batch(shard, keys, arrays, kept, last=True, damaged=damaged)

    @log_worker_exceptions
    def __iter__(self) -> Iterator[dict[str, Any]]:
        info = get_worker_info()
        worker, k = (0, 1) if info is None else (info.id, info.num_workers)
        errors = SlotErrors(self.errors, worker)
        for i, shard in enumerate(self.shards[worker::k]):
            fault_point("data", i)
            for batch in self._shard_batches(shard, errors):
                into_shared_memory(batch["inputs"])
                yield batch
