"""Mid-epoch resume of the training stream: the loader remembers how far into its epoch it is.

Lightning stores the `state_dict()` of a train DataLoader that has one in every checkpoint, and on
resume hands it to `load_state_dict()` before the first batch is drawn. Resuming a checkpoint
taken after batch k of epoch e therefore continues epoch e at batch k with exactly the batches an
uninterrupted run would have trained on next (same shuffle, same per-rank slots): each worker
re-reads its share of the first k batches and drops those samples undecoded
(`ShardStream.skip_batches`). Every rank resumes at the same k, so per-rank step counts stay
equal. A checkpoint taken at the end of an epoch resumes at the start of the next one.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import torch
from loguru import logger

from ae.data.loader import PreemptibleLoader
from ae.data.stream import ShardStream
from ae.forensics.step_times import step_times


class ResumableLoader(PreemptibleLoader):
    """A DataLoader over a `ShardStream` that counts the batches it handed out this epoch, and
    times how long the rank waits for each (`ae.forensics.step_times`)."""

    dataset: ShardStream

    def __init__(self, dataset: ShardStream, **kwargs: Any) -> None:
        super().__init__(dataset, **kwargs)
        self._consumed = 0  # batches of the current epoch already trained on
        self._pending_skip = 0  # set by load_state_dict, applied to the next iteration only

    def __iter__(self) -> Iterator[torch.Tensor]:
        stream = self.dataset
        stream.skip_batches, self._pending_skip = self._pending_skip, 0
        self._consumed = stream.skip_batches
        batches = super().__iter__()
        while True:
            started = time.perf_counter()
            try:
                batch = next(batches)
            except StopIteration:
                return
            step_times.fetched(started, time.perf_counter())  # the rank's data wait
            self._consumed += 1
            yield batch

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.dataset.epoch, "batches": self._consumed}

    def load_state_dict(self, state: dict[str, int]) -> None:
        epoch, done = state["epoch"], state["batches"]
        if done >= len(self):  # saved after the epoch's last batch: the next epoch is next
            epoch, done = epoch + 1, 0
        self.dataset.epoch = epoch
        self._pending_skip = done
        logger.info(
            f"Resuming the train data at epoch {epoch}, batch {done} of {len(self)}"
            + (f" (skipping the {done} batches already trained on)" if done else "")
        )
