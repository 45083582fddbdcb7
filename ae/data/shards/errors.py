"""Bad data: the error lines, and the counts a rank sums up at the end of the run.

Dataloader workers are separate processes, so their counts live in a small shared-memory table,
one row per worker (each worker writes only its own row: no lock, no lost updates). Rows outlive
the workers, and the rank reads them at the end of the run, after the last batch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from loguru import logger

from ae.errors import UserError
from ae.log_lines import BAD_SAMPLE, BAD_SHARD_READ, DATA_ERRORS

if TYPE_CHECKING:
    import torch


class DataError(UserError):
    """The data cannot be trained on (no readable sample, too few for one batch per rank...)."""

    def render(self) -> str:
        return self.brief()

    def brief(self) -> str:
        """The message alone. Raised in a dataloader worker, the error reaches the rank with the
        worker's traceback folded into its text (the worker logged it already). Not named
        `message`: torch re-raises worker errors as `cls(message=...)` when it has that."""
        last = str(self).rstrip().splitlines()[-1]
        return last.removeprefix(f"{__name__}.{type(self).__name__}: ")


BAD_SAMPLES, BAD_SHARDS, REPLACED = range(3)


@dataclass
class ErrorCounts:
    """Per-worker error counters in shared memory (row = dataloader worker id)."""

    table: torch.Tensor

    @classmethod
    def create(cls, num_workers: int) -> ErrorCounts:
        import torch  # here: ae-shards and the launcher read DataError without loading torch

        return cls(torch.zeros((max(1, num_workers), 3), dtype=torch.int64).share_memory_())

    def add(self, worker: int, column: int, n: int = 1) -> None:
        self.table[worker, column] += n

    def totals(self) -> tuple[int, int, int]:
        bad_samples, bad_shards, replaced = (int(v) for v in self.table.sum(dim=0))
        return bad_samples, bad_shards, replaced

    def log_summary(self, split: str) -> None:
        """The run-end line of this rank; WARNING (so also in the train log) when not clean."""
        bad_samples, bad_shards, replaced = self.totals()
        line = DATA_ERRORS.format(
            split=split, bad_samples=bad_samples, bad_shards=bad_shards, replaced=replaced
        )
        (logger.warning if bad_samples or bad_shards else logger.info)(line)


@dataclass
class SlotErrors:
    """What one worker reports: the ERROR line, and its row of the table."""

    counts: ErrorCounts
    worker: int
    last_shard: tuple[str, str] | None = None  # (url, reason) of the last bad shard read

    def bad_sample(self, url: str, key: str, reason: str) -> None:
        logger.error(BAD_SAMPLE.format(key=key, url=url, reason=reason))
        self.counts.add(self.worker, BAD_SAMPLES)

    def bad_shard(
        self, url: str, reason: str, last_key: str | None, lost: int, planned: int
    ) -> None:
        line = BAD_SHARD_READ.format(
            url=url, reason=reason, key=last_key or "-", lost=lost, planned=planned
        )
        logger.error(line)
        self.counts.add(self.worker, BAD_SHARDS)
        self.last_shard = (url, reason)

    def replaced(self, n: int) -> None:
        self.counts.add(self.worker, REPLACED, n)

    def snapshot(self) -> tuple[int, int]:
        """(errors, replaced) so far, for the per-pass COMPLETED line."""
        row = self.counts.table[self.worker]
        return int(row[BAD_SAMPLES] + row[BAD_SHARDS]), int(row[REPLACED])
