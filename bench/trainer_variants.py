"""The variants of `bench.trainer_overhead`'s ae side: ae with one piece of ours taken out, or
put in, so that what each piece costs per step is measured by taking it out."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

# The ae side with one piece of ours taken out (`no_*`) or put in: name -> what changes. The
# pieces are everything of ours that runs per step (docs/BENCHMARKS.md lists their costs).
VARIANTS = {
    "no_loop_tracer": "without the loop tracer (DebugCallback: markers, progress beats and lines,"
    " the step clock)",
    "no_step_times": "without the step clock (data / compute / sync per batch, the comm hook's"
    " note of the all-reduce's start): what the straggler scores and rank series read",
    "no_vote": "without the step vote (stop signal, timed save: two round trips to the job's"
    " c10d store about four times a second)",
    "old_stop_check": "with the stop check as it was: an all-reduce on the training group after"
    " every optimizer step, the host waiting for its answer",
    "no_rank_series": "without the per-rank series (rank 0 reads the heartbeats at the log"
    " cadence, at most once a second)",
    "no_metric_callbacks": "without LearningRates, StepsDone, LoggerRuns, LossCurve",
    "no_loggers": "without the loggers (CSV, TensorBoard: written every 10 steps) and the"
    " LearningRates callback that writes to them",
    "no_minor_callbacks": "without ClockOffset, EpochSync, BadDataBound (no per-step work; their"
    " empty hooks are dispatched every step)",
    "no_watchdog": "without the watchdog thread (a check a second, a heartbeat every 5 s)",
    "no_flight_recorder": "without the Flight Recorder (a few us per collective)",
    "no_nonfinite_guard": "without the non-finite check (NonFiniteGuard: the loss and gradient"
    " norm kept on the device, read on the log cadence; the save guard)",
    "with_ema": "with --ema_decay=0.999 (off by default): the EMA update after every step",
}


def _drop(*kinds: type) -> Callable[[Any], None]:
    """Those callbacks out of the trainer's list, and their per-batch hooks out of the
    `BatchHooks` that calls them (`ae/training/batch_hooks.py`)."""

    def change(trainer: Any) -> None:
        from ae.training.batch_hooks import BatchHooks

        trainer.callbacks = [cb for cb in trainer.callbacks if not isinstance(cb, kinds)]
        for hooks in [cb for cb in trainer.callbacks if isinstance(cb, BatchHooks)]:
            for name, fns in list(hooks.calls.items()):
                fns[:] = [fn for fn in fns if not isinstance(fn.__self__, kinds)]
                if not fns:  # nothing left there: Lightning skips the hook, as without them
                    setattr(hooks, name, None)

    return change


def _boundary(trainer: Any) -> Any:
    from ae.training.step_boundary import StepBoundary

    return next(cb for cb in trainer.callbacks if isinstance(cb, StepBoundary))


def _no_step_times(trainer: Any) -> None:
    """The loop tracer's step clock replaced by one that records nothing, and no note of the
    all-reduce's start in the comm hook (the bench's loader is a plain DataLoader: no data-wait
    clock to take out)."""
    from ae.forensics import loop_tracer
    from ae.training import nonfinite

    class NoClock:
        last, epoch = None, (0, 0.0, 0.0, 0.0)

        def new_epoch(self) -> None: ...
        def restart(self) -> None: ...
        def backward_done(self, now: float) -> None: ...
        def batch_end(self, now: float, steps: int) -> None: ...

    loop_tracer.step_times = NoClock()  # type: ignore[assignment]
    nonfinite.gradients_ready = lambda: None


def _no_vote(trainer: Any) -> None:
    from ae.training.step_vote import StepVote

    class NoVote(StepVote):
        def start(self, world_size: int, timeout: Any, store: Any = None) -> None:
            pass  # no store: the rank's own flags decide

    _boundary(trainer).vote = NoVote()


def _old_stop_check(trainer: Any) -> None:
    """Puts back what the vote replaced: after every optimizer step, one all-reduce on the
    training group whose answer the host waits for (Lightning's reduce_boolean_decision)."""
    import lightning as L

    from ae.training.preemption import stop_signal_received

    class OldStopCheck(L.Callback):
        seen = -1

        def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
            if trainer.global_step != self.seen:
                self.seen = trainer.global_step
                trainer.strategy.reduce_boolean_decision(stop_signal_received(), all=False)

    trainer.callbacks.append(OldStopCheck())


def _no_rank_series(trainer: Any) -> None:
    _boundary(trainer).rank_series = None


def _no_loggers(trainer: Any) -> None:
    from ae.training.metrics import LearningRates

    trainer.loggers = []
    _drop(LearningRates)(trainer)


def change_trainer(variant: str, trainer: Any) -> None:
    """The change of `variant` to a built trainer (none for those that change what the rank
    starts: the watchdog, the Flight Recorder, the EMA's flag)."""
    from ae.data.bad_data_limit import BadDataBound
    from ae.data.epoch_sync import EpochSync
    from ae.forensics.loop_tracer import DebugCallback
    from ae.training.clock import ClockOffset
    from ae.training.loss_curve import LossCurve
    from ae.training.metrics import LearningRates, LoggerRuns, StepsDone
    from ae.training.nonfinite import NonFiniteGuard

    changes: dict[str, Callable[[Any], None]] = {
        "no_loop_tracer": _drop(DebugCallback),
        "no_step_times": _no_step_times,
        "no_vote": _no_vote,
        "old_stop_check": _old_stop_check,
        "no_rank_series": _no_rank_series,
        "no_metric_callbacks": _drop(LearningRates, StepsDone, LoggerRuns, LossCurve),
        "no_nonfinite_guard": _drop(NonFiniteGuard),
        "no_loggers": _no_loggers,
        "no_minor_callbacks": _drop(ClockOffset, EpochSync, BadDataBound),
    }
    if variant in changes:
        changes[variant](trainer)
