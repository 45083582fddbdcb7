"""DataLoaders whose worker processes leave stop signals to their rank, and the exit-time reaper.

Dataloader workers are in their rank's process group, so a stop signal for the job (SIGTERM:
preemption, `scancel`; SIGINT: Ctrl-C through the launcher) reaches them too. Were they to die of
it mid-batch, the rank's clean save (`ae.training.preemption`) would die with them. So workers
ignore both and their rank shuts them down; the signals are held back while they are forked, so
none can die of one before its handler is in place.
"""

from __future__ import annotations

import atexit
import multiprocessing
import signal
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch.utils.data import DataLoader, get_worker_info

from ae.process_end import die_with_parent
from logging_cfg import streams_to_native_in_child

STOP_SIGNALS = {signal.SIGTERM, signal.SIGINT}


@contextmanager
def sigterm_blocked() -> Iterator[None]:
    """Hold the stop signals back (they stay pending) while dataloader workers are forked: they
    inherit the block, so none can die of one before `init_worker` runs."""
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def init_worker(worker_id: int) -> None:
    """DataLoader `worker_init_fn`: replaces torch's worker SIGTERM handler (which dies), and
    Python's SIGINT one (KeyboardInterrupt ends torch's worker loop); a worker of the console
    rank writes its Python-level output to the rank's native log, not to the console. It dies
    with its rank: torch's worker notices a dead rank only between two batches, so one blocked
    in a read (a hung mount, a stalled stream) outlived a SIGKILLed rank."""
    if (parent := multiprocessing.parent_process()) is not None and parent.pid is not None:
        die_with_parent(signal.SIGKILL, parent.pid)
    streams_to_native_in_child()
    for signum in STOP_SIGNALS:
        signal.signal(signum, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)


def into_shared_memory(tensor: torch.Tensor) -> torch.Tensor:
    """In a dataloader worker, move a batch tensor into shared memory before it is yielded.

    Torch would do it anyway, in the worker's queue thread, as the batch is sent: there a full
    /dev/shm is a traceback printed on stderr and the batch silently lost; once the worker ends
    its pass the loader skips the missing batch, so this rank's epoch is one batch short and the
    ranks' collectives no longer match (a hang). Here the same allocation fails in the worker's
    own iteration: torch raises it in the rank (`No space left on device` in shared memory,
    which ae-diagnose names `shared memory exhausted`). The copy is the one torch would make."""
    if get_worker_info() is not None:
        tensor.share_memory_()
    return tensor


def _kill_leftover_workers() -> None:
    """At exit, kill the dataloader workers still running. They ignore SIGTERM, and
    multiprocessing's own exit handler stops daemonic children with SIGTERM and then joins them:
    a rank leaving on an exception (its loader iterator still alive in the traceback) would wait
    for them forever, and its peers with it, in their next all-reduce."""
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)  # torch's handler would report the kills
    for child in multiprocessing.active_children():
        if child.daemon:
            child.kill()


def install_worker_reaper() -> None:
    """Register the exit-time kill of leftover workers. Call once from the rank's entry point,
    after torch is imported: atexit runs handlers last-registered first, so this runs before
    multiprocessing's own handler (registered when torch imports it)."""
    atexit.register(_kill_leftover_workers)


# Seconds to wait before workers are forked (once for persistent train workers, at each
# validation for the others): far below a run's cost, far above a thread's hand-back.
FORK_SETTLE_S = 0.1


class PreemptibleLoader(DataLoader):
    """A DataLoader whose worker processes leave stop signals to their rank."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, worker_init_fn=init_worker, **kwargs)
        # Persistent workers are forked by the first iterator only; later ones reuse them.
        self._persistent_workers_started = False

    def __iter__(self) -> Iterator[Any]:
        forks = self.num_workers > 0 and not self._persistent_workers_started
        if forks:
            # Workers are about to be forked: let the communication library's threads finish
            # what a collective just left them (a Python thread state made or deleted on their
            # side). A fork in that instant copies CPython 3.11's runtime lock held, and the
            # worker deadlocks at birth (seen after the setup collectives and after the last
            # step's all-reduce, 1-2% of launches under load).
            time.sleep(FORK_SETTLE_S)
        with sigterm_blocked():  # workers start in the iterator's constructor
            iterator = super().__iter__()
        if forks and self.persistent_workers:
            self._persistent_workers_started = True
        return iterator
