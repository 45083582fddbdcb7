"""A stop signal -- SIGTERM (preemption, `scancel`, `docker stop`) or SIGINT (Ctrl-C) -- makes
every rank save a checkpoint and stop cleanly.

The chain: the launcher forwards the signal to torchrun (`ae.cli.launch`), torchrun signals each
rank's process group, a rank's handler only records the signal and its time (no logging, no
collectives: either could deadlock inside a signal handler), and the ranks agree at a step
boundary, off the training process group and without a device sync (`ae.training.step_vote`:
a vote about four times a second, read one step later): if any rank was signalled, every rank
saves the same step checkpoint (collective save), logs `PREEMPTED`, and stops. The rank
processes exit 0; torchrun always fails when signalled, so the launcher exits 143 (128 +
SIGTERM, what a job scheduler expects of a terminated job) or 130 (128 + SIGINT, Ctrl-C) and
says whether the checkpoint was saved.

Lightning installs its own SIGTERM handler at fit start, which broadcasts from inside the handler;
ours replaces it when training starts. Dataloader workers ignore both signals (they are in the
rank's process group, so they get them too): their rank shuts them down, instead of them dying
mid-batch and taking the rank's clean save with them (`ae.data.stream.loader`).
"""

from __future__ import annotations

import signal
from typing import Any

import lightning as L
from loguru import logger

from ae.forensics.progress import STUCK_AFTER_S, progress
from ae.forensics.stall_report import frame_doing
from ae.log_lines import PREEMPTED, STOP_SIGNAL_STUCK, STUCK_MAIN_THREAD, main_log
from ae.training.checkpointing import Checkpointing, current_lr

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class SigtermWhileStuck(SystemExit):
    """Raised by the stop-signal handler (SIGTERM or SIGINT) in a rank that has made no progress
    for `STUCK_AFTER_S`: it leaves through its `finally` blocks; the rank's entry point logs why
    (never the handler: logging there could re-enter a sink that the interrupted code was
    writing)."""

    def __init__(
        self, idle_s: float, phase: str, step: int, signum: int = signal.SIGTERM,
        doing: str = "unknown",
    ) -> None:  # fmt: skip
        super().__init__(128 + signum)
        self.idle_s, self.phase, self.step, self.doing = idle_s, phase, step, doing
        self.signal = signal.Signals(signum).name

    def describe(self) -> str:
        """The line, with what the main thread was stuck in (a collective: waiting for a peer;
        else its own work): ae-diagnose names the rank that held the job back from it."""
        return STOP_SIGNAL_STUCK.format(
            signal=self.signal, idle=f"{self.idle_s:.0f}", phase=self.phase, step=self.step
        ) + STUCK_MAIN_THREAD.format(doing=self.doing)


def on_stop_signal(signum: int, frame: Any) -> None:
    """Records the first stop signal in `progress` (plain stores; the watchdog thread logs it),
    and leaves a stuck rank. No logging and no collectives here: the handler runs between two
    bytecodes of whatever the main thread was doing, a log write included."""
    progress.record_stop_signal(signal.Signals(signum).name)
    # Stuck when the signal comes -- or, when it came to a busy rank, when the watchdog delivers
    # it again after STUCK_AFTER_S without progress (`ae.forensics.watchdog`).
    if (idle := progress.idle_s()) > STUCK_AFTER_S:
        doing = frame_doing(frame, progress.phase)  # where the signal found the main thread
        raise SigtermWhileStuck(idle, progress.phase, progress.step, signum, doing)


def stop_signal_received() -> bool:
    return progress.stop_signal is not None


class Preemption(L.Callback):
    """Saves and stops on all ranks together when they agree on a stop signal (the step boundary
    asks the vote, `ae.training.step_boundary`)."""

    def __init__(self, checkpointing: Checkpointing) -> None:
        self.checkpointing = checkpointing
        self.stopped_at: int | None = None

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        for signum in STOP_SIGNALS:  # replaces Lightning's SIGTERM handler (and KeyboardInterrupt)
            signal.signal(signum, on_stop_signal)

    def after_step(self, trainer: L.Trainer, stop: bool) -> None:
        """After optimizer step `trainer.global_step` and its checkpoint if due (`StepBoundary`);
        `stop`: the ranks agreed that some rank got a stop signal (`ae.training.step_vote`:
        ranks may be signalled at different steps, and all must save the same one)."""
        if self.stopped_at is not None or not stop:
            return
        step = trainer.global_step
        if line := progress.stop_line():  # before the save, if the watchdog has not said it
            logger.warning(line)
        ckpt = self.checkpointing
        path = ckpt.store.last if ckpt.saved_step == step else ckpt.save_step(trainer, "preemption")
        log = main_log if trainer.is_global_zero else logger
        # The signal this rank got; `peer` when only a peer had one by this step.
        name = progress.stop_signal or "peer"
        lr = f"{current_lr(trainer):.8g}"
        log.warning(PREEMPTED.format(signal=name, step=step, path=path, lr=lr))
        self.stopped_at = step
        trainer.should_stop = True


def preempted_at(trainer: L.Trainer) -> int | None:
    """The step at which a stop signal stopped this fit, or None."""
    found = [cb.stopped_at for cb in trainer.callbacks if isinstance(cb, Preemption)]
    return found[0] if found else None
