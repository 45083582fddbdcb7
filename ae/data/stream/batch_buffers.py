"""Train batches handed to the rank in shared-memory buffers that each worker reuses.

A dataloader worker hands every batch to its rank in shared memory. A new segment per batch
costs its pages every time: the kernel allocates and zeroes each one as the worker first writes
it, and frees it after the rank is done (on the 2-core VM: a 16 MB batch gathered in 3.7 ms,
moved into a new segment 16 ms; ~55 us of a ~400 us JPEG image). So each train worker keeps
`SLOTS` buffers for an epoch and writes batch n into buffer n % SLOTS, once the rank has let go
of the batch that buffer held before. Between epochs it holds none (validation's workers need
the room then, as before).

The rank lets go of a batch when nothing of it is left there: the finalizer of the batch's
storage (the last tensor, view or array over it freed) writes the batch's number into
`released[worker, slot]`, a table in shared memory made before the workers are forked. With
pinned memory (a GPU) the loader's pin thread copies each batch and drops it at once, so the
batch is let go as it arrives; on a CPU it lives until the step (and whatever kept it) is done.
A worker reuses a buffer only if that table shows its last batch was let go; otherwise the batch
takes a new segment, as torch would do (a worker never waits on the rank: a rank that stops
reading holds nobody up). Batch numbers start at a random base in each epoch of each worker,
so a release that reaches the table late, from an earlier epoch or worker process, never
matches.
"""

from __future__ import annotations

import random
import weakref
from collections.abc import Iterator
from typing import Any

import torch

from ae.data.stream.loader import into_shared_memory

# Buffers per worker: the loader's prefetch (batches a worker may have handed over that the rank
# has not received) and one the rank may still be training on. `ae.job.preflight` counts them.
SLOTS = 5
Tag = tuple[int, int, int]  # (worker, slot, batch number)


def release_table(num_workers: int) -> torch.Tensor:
    """`released[worker, slot]`: the number of the batch the rank last let go of, per buffer."""
    return torch.full((max(1, num_workers), SLOTS), -1, dtype=torch.int64).share_memory_()


class WorkerBuffers:
    """In one dataloader worker, for one epoch: the buffers its batches go out in, in turn."""

    def __init__(self, worker: int, released: torch.Tensor) -> None:
        self.worker, self.released = worker, released
        self.buffers: list[torch.Tensor | None] = [None] * SLOTS
        self.numbers = [-1] * SLOTS  # the batch each buffer last held
        self.next = random.getrandbits(62)  # this epoch's batch numbers (see the module doc)

    def hand_over(self, batch: torch.Tensor) -> tuple[torch.Tensor, Tag]:
        """`batch` in a buffer of this worker's (reused when the rank let go of it), with its tag
        for the rank."""
        number, self.next = self.next, self.next + 1
        slot = number % SLOTS
        buffer = self.buffers[slot]
        if (
            buffer is not None
            and int(self.released[self.worker, slot]) == self.numbers[slot]
            and buffer.shape == batch.shape
            and buffer.dtype == batch.dtype
        ):
            buffer.copy_(batch)
        else:  # the rank may still hold it: a new segment, and the buffer from now on
            buffer = into_shared_memory(batch)
            self.buffers[slot] = buffer
        self.numbers[slot] = number
        return buffer, (self.worker, slot, number)


def _let_go(released: torch.Tensor, tag: Tag) -> None:
    worker, slot, number = tag
    released[worker, slot] = number


def received(released: torch.Tensor, batches: Iterator[Any]) -> Iterator[torch.Tensor]:
    """On the rank: the batches of tagged `(batch, tag)` items, each let go of when freed."""
    for batch, tag in batches:
        if batch.is_pinned():  # a copy: the shared buffer was dropped after the pin thread's copy
            _let_go(released, tag)
        else:
            weakref.finalize(batch.untyped_storage(), _let_go, released, tuple(tag))
        yield batch
