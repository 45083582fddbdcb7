"""SIGTERM (preemption, `scancel`, `docker stop`): every rank saves a checkpoint and stops cleanly.

The chain: the launcher forwards SIGTERM to torchrun (`ae.launch`), torchrun signals each
rank's process group, a rank's handler only records the time (no logging, no collectives: either
could deadlock inside a signal handler), and at the next optimizer-step boundary all ranks agree
with one all-reduce: if any rank was signalled, every rank saves the same step checkpoint
(collective save), logs `PREEMPTED`, and stops. The rank processes exit 0; torchrun always fails
when signalled, so the launcher exits 143 (128 + SIGTERM, what a job scheduler expects of a
terminated job) and says whether the checkpoint was saved.

Lightning installs its own SIGTERM handler at fit start, which broadcasts from inside the handler;
ours replaces it when training starts. Dataloader workers ignore SIGTERM (they are in the rank's
process group, so they get it too): their rank shuts them down, instead of them dying mid-batch
and taking the rank's clean save with them (`PreemptibleLoader`).
"""

from __future__ import annotations

import atexit
import multiprocessing
import signal
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import lightning as L
from loguru import logger
from torch.utils.data import DataLoader

from ae.checkpointing import Checkpointing, current_lr
from ae.log_lines import PREEMPTED, main_log
from ae.progress import progress

_received_at: float | None = None  # time.time() of the first SIGTERM

# A rank that has made no progress for this long when SIGTERM comes will not reach the next step
# boundary to save: it is stuck (a hang, or waiting for a peer that died -- torchrun's SIGTERM
# after a peer failure). It leaves at once through the exception path instead, so its `finally`
# blocks run and its log says why, rather than being SIGKILLed by torchrun 30 s later.
STUCK_AFTER_S = 10.0


def _on_sigterm(signum: int, frame: Any) -> None:
    global _received_at
    if _received_at is None:
        _received_at = time.time()
    if (idle := progress.idle_s()) > STUCK_AFTER_S:
        logger.warning(
            f"SIGTERM after {idle:.0f}s without progress in phase {progress.phase} (step "
            f"{progress.step}): exiting now, without a checkpoint"
        )
        raise SystemExit(128 + signal.SIGTERM)


def sigterm_received() -> bool:
    return _received_at is not None


@contextmanager
def sigterm_blocked() -> Iterator[None]:
    """Hold SIGTERM back (it stays pending) while dataloader workers are forked: they inherit
    the block, so none can die of it before `ignore_sigterm_in_worker` runs."""
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def ignore_sigterm_in_worker(worker_id: int) -> None:
    """DataLoader `worker_init_fn`: replaces torch's worker SIGTERM handler (which dies)."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})


def _kill_leftover_workers() -> None:
    """At exit, kill the dataloader workers still running. They ignore SIGTERM, and
    multiprocessing's own exit handler stops daemonic children with SIGTERM and then joins them:
    a rank leaving on an exception (its loader iterator still alive in the traceback) would wait
    for them forever, and its peers with it, in their next all-reduce."""
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)  # torch's handler would report the kills
    for child in multiprocessing.active_children():
        if child.daemon:
            child.kill()


# Registered after multiprocessing's exit handler (imported with torch above): runs before it.
atexit.register(_kill_leftover_workers)


class PreemptibleLoader(DataLoader):
    """A DataLoader whose worker processes leave SIGTERM to their rank."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, worker_init_fn=ignore_sigterm_in_worker, **kwargs)

    def __iter__(self) -> Iterator[Any]:
        with sigterm_blocked():  # workers start in the iterator's constructor
            return super().__iter__()


class Preemption(L.Callback):
    """Checks for SIGTERM at every optimizer step; saves and stops on all ranks together."""

    def __init__(self, checkpointing: Checkpointing) -> None:
        self.checkpointing = checkpointing
        self.stopped_at: int | None = None
        self._seen_step = -1

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        signal.signal(signal.SIGTERM, _on_sigterm)  # replaces Lightning's handler
        self._seen_step = trainer.global_step

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, idx: int
    ) -> None:
        step = trainer.global_step
        if step == self._seen_step or self.stopped_at is not None:
            return
        self._seen_step = step
        # One tiny all-reduce per optimizer step: ranks may be signalled at different steps.
        if not trainer.strategy.reduce_boolean_decision(sigterm_received(), all=False):
            return
        if _received_at is not None:
            logger.warning(f"SIGTERM received {time.time() - _received_at:.1f}s ago")
        ckpt = self.checkpointing
        path = ckpt.store.last if ckpt.saved_step == step else ckpt.save_step(trainer, "preemption")
        log = main_log if trainer.is_global_zero else logger
        log.warning(PREEMPTED.format(step=step, path=path, lr=f"{current_lr(trainer):.8g}"))
        self.stopped_at = step
        trainer.should_stop = True


def preempted_at(trainer: L.Trainer) -> int | None:
    """The step at which a SIGTERM stopped this fit, or None."""
    found = [cb.stopped_at for cb in trainer.callbacks if isinstance(cb, Preemption)]
    return found[0] if found else None
