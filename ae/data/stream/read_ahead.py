"""Batches read by one background thread, a few ahead of the training thread.

With `--num_workers=0` the rank reads its batches itself. On a GPU the training thread only
queues each step's kernels and then waits for its next batch: read on that thread, the batch's
reading (the fixed-layout path's gather from the mapped shards, the pinned copy) runs while the
GPU has nothing to do. One thread reading ahead overlaps it with the step instead. The heavy
parts (numpy's gather, torch's pinned copy) release the GIL, so the two threads run side by side.

One thread, in order: the batches, their order and every resume arithmetic are those of the
loader it reads (nothing here knows of positions). Its exceptions are raised in the consumer, as
the loader would have raised them; closing the generator (Lightning leaving an epoch early, a
stop) stops the thread after the batch it is reading (waited for up to `JOIN_S`: a read that
hangs, say a stalled `pipe:`, is left to the daemon thread). It is used only without dataloader
workers, so no process is forked while it reads: a fork would copy its locks mid-read.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterator
from typing import TypeVar

T = TypeVar("T")

# Batches read ahead: enough to cover a slow read among fast ones, few enough that pinned
# memory stays small (each is one batch's bytes).
DEPTH = 3
_END = object()  # the source is exhausted
_POLL_S = 0.1  # how often a blocked producer looks whether the consumer left
JOIN_S = 10.0  # how long a closed reader is waited for


class _Raised:
    """The source's exception, carried to the consumer."""

    def __init__(self, error: BaseException) -> None:
        self.error = error


def read_ahead(
    batches: Iterator[T],
    depth: int = DEPTH,
    on_start: Callable[[], None] | None = None,
    name: str = "ae-read-ahead",
) -> Iterator[T]:
    """Yield what `batches` yields, in order, read by a daemon thread up to `depth` ahead;
    `on_start` runs first in that thread."""
    ready: queue.Queue = queue.Queue(maxsize=depth)
    left = threading.Event()  # the consumer is gone: stop reading

    def put(item: object) -> bool:
        while not left.is_set():
            try:
                ready.put(item, timeout=_POLL_S)
                return True
            except queue.Full:
                continue
        return False

    def produce() -> None:
        try:
            if on_start is not None:
                on_start()
            for batch in batches:
                if not put(batch):
                    return
            put(_END)
        except BaseException as e:
            put(_Raised(e))

    thread = threading.Thread(target=produce, name=name, daemon=True)
    thread.start()
    try:
        while True:
            item = ready.get()
            if item is _END:
                return
            if isinstance(item, _Raised):
                raise item.error
            yield item
    finally:
        left.set()
        thread.join(JOIN_S)
