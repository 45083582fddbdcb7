"""How fast each dataloader worker reads: its current shard, bytes/s from it, time per batch.

Workers are separate processes, so their figures live in a small shared-memory table, one row
per worker, like the error counts (`ae.data.shards.errors`): each worker writes only its own row,
once per batch, and the rank's watchdog thread reads the table for the heartbeat (`data_workers`).
A worker's time is the time it spends producing batches: suspended at a `yield` (its batch
waiting to be taken) it is not counted, so a worker that is merely ahead of the rank reads fast,
and one held up by slow storage or slow decoding reads slowly. A worker stopped or starved of
CPU between batches is not slow by these figures: the rank's data wait then exceeds the
worker's time per batch, which the straggler evidence points out (`ae.stragglers`).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ae.data.shards.tar_samples import ByteCount

# Columns of a worker's row (float64).
SHARD, SHARD_BYTES, SHARD_BUSY, BATCHES, BATCH_S, PID, UPDATED = range(7)
# Weight of the newest batch in the time-per-batch average: about the last 10 batches count.
BATCH_EMA = 0.2


@dataclass
class WorkerStats:
    """Per-worker read figures in shared memory (row = dataloader worker id)."""

    table: torch.Tensor

    @classmethod
    def create(cls, num_workers: int) -> WorkerStats:
        return cls(torch.zeros((max(1, num_workers), 7), dtype=torch.float64).share_memory_())

    def meter(self, worker: int) -> SlotMeter:
        return SlotMeter(self.table.numpy()[worker])

    def rows(self, urls: list[str]) -> list[dict[str, Any]]:
        """HEARTBEAT `data_workers`: the workers that have produced a batch."""
        out = []
        for w, row in enumerate(self.table.numpy().copy()):
            if row[PID] == 0:
                continue
            shard = int(row[SHARD])
            busy = row[SHARD_BUSY]
            out.append({
                "worker": w,
                "pid": int(row[PID]),
                "shard": urls[shard] if 0 <= shard < len(urls) else None,
                "mb_per_s": round(row[SHARD_BYTES] / busy / 1e6, 3) if busy > 0 else None,
                "batch_ms": round(1000 * row[BATCH_S], 3) if row[BATCHES] else None,
                "batches": int(row[BATCHES]),
                "updated": round(float(row[UPDATED]), 3),
            })  # fmt: skip
        return out


class SlotMeter:
    """What one worker (or the rank, with 0 workers) reports: `count` gets the bytes read,
    `shard` is called when it opens a shard, `batch` once per batch produced."""

    def __init__(self, row: np.ndarray) -> None:
        self.row = row
        self.count = ByteCount()
        self._shard, self._shard_start, self._shard_busy = -1, 0, 0.0
        self._batches, self._batch_s = 0, 0.0
        row[:] = (-1, 0, 0, 0, 0, os.getpid(), time.time())

    def shard(self, index: int) -> None:
        self._shard, self._shard_start, self._shard_busy = index, self.count.n, 0.0

    def reading(self, index: int) -> None:
        """The shard that the current batch comes from, when a worker reads all of its shards at
        once (the columnar path's shuffled gathers): the rate stays the worker's whole rate."""
        self._shard = index

    def batch(self, busy_s: float) -> None:
        self._shard_busy += busy_s
        self._batches += 1
        self._batch_s = busy_s if self._batches == 1 else (
            BATCH_EMA * busy_s + (1 - BATCH_EMA) * self._batch_s
        )  # fmt: skip
        # One row write per batch (a read that races it mixes two batches' figures: harmless).
        self.row[:] = (
            self._shard, self.count.n - self._shard_start, self._shard_busy, self._batches,
            self._batch_s, self.row[PID], time.time(),
        )  # fmt: skip
