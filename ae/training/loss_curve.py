"""`<output_dir>/loss_curve.png` (rank 0): train and val loss of the run's line (the run and
those it resumed, `NumberedCSVLogger.first_run`), read back from their `metrics.csv`, drawn when
fitting ends: normally, preempted, or failed (what was logged up to the failure; a NaN that
stopped the run is marked on it)."""

from __future__ import annotations

import math

import lightning as L
from loguru import logger

from ae.log_lines import main_log
from ae.run_paths import RunDir
from ae.training.loss_history import read_epoch_ends, read_loss_history
from ae.training.metrics import NumberedCSVLogger
from ae.training.model_check import not_logged
from ae.training.nonfinite import NonFiniteGuard
from ae.training.plots import loss_plot


def no_loss_curve(logged: list[str]) -> str:
    """The warning for a run that logged neither series of the loss curve."""
    calls = (
        'them with self.log("train/loss", loss) in training_step and self.log("val/loss", '
        "loss, sync_dist=True) in validation_step"
    )
    return not_logged("No loss curve", "train/loss or val/loss", logged, calls)


class LossCurve(L.Callback):
    """Renders `loss_curve.png` when fitting ends, or fails."""

    def __init__(self, run_dir: RunDir) -> None:
        self.run_dir = run_dir
        self.cut_epoch: int | None = None  # an epoch that --max_steps ended before its last batch

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # Its mean so far is logged as `train/loss_epoch` too (ae.training.model), which reads
        # as the epoch's end: the curve's top axis would count it among the epochs done.
        self.cut_epoch = None if trainer.is_last_batch else trainer.current_epoch

    def epoch_ends(self, since: str = "") -> list[tuple[float, int]]:
        """(step, epoch) of the run's whole epochs: not one that this run's --max_steps cut;
        `since`: the run's line's first `<TS>` (`NumberedCSVLogger.first_run`)."""
        ends = read_epoch_ends(self.run_dir.metrics, since)
        return [(step, epoch) for step, epoch in ends if epoch != self.cut_epoch]

    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.draw(trainer)

    def on_exception(
        self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException
    ) -> None:
        # A failed run's curve (a NaN that stopped it, a peer that died) is the one most looked
        # at; drawn as best it can be: nothing here may hide the failure itself.
        try:
            self.draw(trainer, failed=True)
        except Exception as e:
            logger.warning(f"Loss curve not drawn after the failure: {type(e).__name__}: {e}")

    def draw(self, trainer: L.Trainer, failed: bool = False) -> None:
        csvs = [lg for lg in trainer.loggers if isinstance(lg, NumberedCSVLogger)]
        if not trainer.is_global_zero or not csvs:  # without csv: said at the start
            return
        for lg in trainer.loggers:
            lg.save()  # loggers are finalized only after this hook
        since = csvs[0].first_run
        history = read_loss_history(self.run_dir.metrics, since)
        if not any(math.isfinite(y) for pts in history.values() for _, y in pts):
            if not any(history.values()) and not failed:  # a LightningModule's own names
                main_log.warning(no_loss_curve(list(trainer.callback_metrics)))
            return
        path = self.run_dir.loss_curve
        guards = [cb for cb in trainer.callbacks if isinstance(cb, NonFiniteGuard)]
        marks = guards[0].events if guards else []
        loss_plot(history, path, marks=marks, epoch_ends=self.epoch_ends(since))
        main_log.info(f"Loss curve{' (up to the failure)' if failed else ''}: {path}")
