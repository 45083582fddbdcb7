"""Metrics of a run (rank 0): the loggers of `--logger` (CSV, TensorBoard, W&B, MLflow, all
Lightning's own), the run ids that let a resumed run continue the same logger runs, and the
loss-curve PNG at the end.

Files: `<output_dir>/metrics/<TS>/metrics.csv`, `<output_dir>/tensorboard/<TS>/`,
`<output_dir>/wandb/` (W&B's own folder; `WANDB_MODE=offline` keeps it there), the MLflow file
store `<output_dir>/mlruns/` (unless `--mlflow_tracking_uri`), and `<output_dir>/loss_curve.png`.

Steps: every metric is logged at the number of optimizer steps done (what the console, the
checkpoint names and `global_step` say). Lightning hands its loggers that number minus one for
the step metrics (it counts the step only after handing them over), and the loggers here take
the step from the trainer instead (`StepsDoneNumbering`, wired by `StepsDone`): train, epoch and
validation metrics, of the built-in models and of a LightningModule of the user's alike. A
`self.log("step")` with every batch of metrics did the same through Lightning's result
collection, some 1,000 Python calls each time (docs/BENCHMARKS.md). The LR is logged by
`LearningRates` at the same steps (Lightning's monitor logs it one step earlier).

Resume: each checkpoint records the loggers' run ids (LOGGER_RUNS); a run resumed from it
continues those runs (the same TensorBoard folder, W&B run id, MLflow run id), its steps going on
from the checkpoint's. The CSV is per launch, and the loss curve joins them (a run that starts
at step s replaces what earlier runs logged from step s on, since it branched from their
checkpoint).
"""

from __future__ import annotations

import math
import os
import secrets
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import lightning as L
import numpy as np
from lightning.pytorch.loggers import (
    CSVLogger,
    Logger,
    MLFlowLogger,
    TensorBoardLogger,
    WandbLogger,
)
from lightning.pytorch.utilities import rank_zero_only
from PIL import Image

from ae.config import ConfigError, ObservabilityConfig, logger_names
from ae.log_lines import main_log
from ae.run_paths import RunDir
from ae.training.loss_history import read_epoch_ends, read_loss_history
from ae.training.nonfinite import NonFiniteGuard
from ae.training.plots import loss_plot

GRID_TAG = "samples/reconstructions"  # inputs above their reconstructions
LOG_EVERY_N_STEPS = 10  # the loggers' cadence (Trainer log_every_n_steps), for runs of 100+ steps
# The checkpoint's record of the loggers' runs: {logger name: run id}.
LOGGER_RUNS = "ae_logger_runs"


def build_loggers(
    obs: ObservabilityConfig,
    run_dir: RunDir,
    run_ts: str,
    runs: dict[str, str],
    resumed_step: int | None = None,
) -> list[Logger]:
    """The loggers of `--logger`, continuing the runs in `runs` (from the checkpoint resumed,
    saved after optimizer step `resumed_step`). One that cannot be made (MLflow checks its URI
    here) is a ConfigError naming it."""
    loggers = []
    for name in logger_names(obs.logger):
        try:
            loggers.append(_make_logger(name, obs, run_dir, run_ts, runs.get(name), resumed_step))
        except Exception as e:  # any library's failure to start is the same user problem
            raise _cannot_start(name, e) from None
    return loggers


class StepsDoneNumbering:
    """Before a Lightning logger class: its metrics at `steps_done()` (the trainer's optimizer
    steps done) whatever step Lightning hands it; Lightning's own until `StepsDone` sets it.

    `add`: metrics of ae's own (the LRs, the per-rank series) written with those Lightning hands
    over at the same step, in one write: TensorBoard's costs ~140 us whatever it holds, and the
    CSV gets one row. If none come at that step, they are written on their own at the next
    `save` (Lightning saves after every handover) or at the end."""

    steps_done: Callable[[], int] | None = None
    _pending: tuple[int, dict[str, float]] | None = None

    def add(self, metrics: Mapping[str, float], step: int) -> None:
        if self._pending is not None and self._pending[0] == step:
            self._pending[1].update(metrics)
            return
        self._flush()
        self._pending = (step, dict(metrics))

    def _flush(self) -> None:
        if self._pending is not None:
            step, metrics = self._pending
            self._pending = None
            super().log_metrics(metrics, step)  # type: ignore[misc]

    def log_metrics(self, metrics: Mapping[str, float], step: int | None = None) -> None:
        if self.steps_done is not None:
            step = self.steps_done()
        if self._pending is not None and self._pending[0] == step:
            metrics = {**self._pending[1], **metrics}
            self._pending = None
        else:
            self._flush()
        super().log_metrics(metrics, step)  # type: ignore[misc]

    def save(self) -> None:
        self._flush()
        super().save()  # type: ignore[misc]

    def finalize(self, status: str) -> None:
        self._flush()
        super().finalize(status)  # type: ignore[misc]


class NumberedCSVLogger(StepsDoneNumbering, CSVLogger):
    pass


class NumberedTensorBoardLogger(StepsDoneNumbering, TensorBoardLogger):
    pass


class NumberedWandbLogger(StepsDoneNumbering, WandbLogger):
    pass


def _make_logger(
    name: str,
    obs: ObservabilityConfig,
    run_dir: RunDir,
    run_ts: str,
    run_id: str | None,
    resumed_step: int | None,
) -> Logger:
    if name == "csv":
        # CSVLogger(root, name, version) writes <root>/<name>/<version>/: metrics/<TS>/.
        return NumberedCSVLogger(run_dir.root, name=run_dir.metrics.name, version=run_ts)
    if name == "tensorboard":
        # A continued run drops the points its folder holds past the checkpoint's step (those
        # of an attempt that died after the save, trained again now): SummaryWriter's
        # `purge_step`. Else TensorBoard draws both, a zigzag where they differ.
        purge = resumed_step + 1 if run_id is not None and resumed_step is not None else None
        return NumberedTensorBoardLogger(
            run_dir.root, run_dir.tensorboard.name, version=run_id or run_ts,
            default_hp_metric=False, purge_step=purge,
        )  # fmt: skip
    if name == "wandb":
        return NumberedWandbLogger(
            project=obs.experiment, save_dir=str(run_dir.root), name=run_dir.root.name,
            id=run_id or f"ae-{run_ts}-{secrets.token_hex(3)}", resume="allow",
        )  # fmt: skip
    uri = obs.mlflow_tracking_uri
    if uri is None:
        uri = run_dir.mlruns.resolve().as_uri()
        # MLflow 3 keeps its file store in maintenance and refuses it unless this is set; a
        # store under the run folder, with no server, is what offline runs need.
        os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
    return ResumableMLFlowLogger(
        experiment_name=obs.experiment, tracking_uri=uri, run_id=run_id, run_name=run_ts
    )


class ResumableMLFlowLogger(StepsDoneNumbering, MLFlowLogger):
    """Lightning's MLFlowLogger, except that a resumed run logs only the hyperparameters its
    MLflow run does not hold yet: MLflow refuses to change a logged parameter, and a resume may
    change some (the LR scaled for another world size, a flag; the train log lists them as
    `Settings changed since the checkpoint`)."""

    @rank_zero_only
    def log_hyperparams(self, params: dict[str, Any]) -> None:
        held = self.experiment.get_run(self.run_id).data.params
        fresh = {k: v for k, v in dict(params).items() if k not in held}
        if fresh:
            super().log_hyperparams(fresh)


def _cannot_start(name: str, e: Exception) -> ConfigError:
    first = str(e).strip().splitlines()[0] if str(e).strip() else ""
    return ConfigError([f"logger: {name} cannot start: {type(e).__name__}: {first}"])


def _logger_name(lg: Logger) -> str:
    kinds = ((CSVLogger, "csv"), (TensorBoardLogger, "tensorboard"), (WandbLogger, "wandb"),
             (MLFlowLogger, "mlflow"))  # fmt: skip
    return next((name for kind, name in kinds if isinstance(lg, kind)), type(lg).__name__)


def start_loggers(loggers: list[Logger]) -> None:
    """Start each logger's run now (rank 0, before training): one that cannot (a bad tracking
    URI, W&B not logged in and not offline) is a ConfigError naming it, not a failure mid-run.
    Then one console line says where each run's metrics go."""
    for lg in loggers:
        try:
            _ = lg.experiment
        except Exception as e:  # any library's failure to start is the same user problem
            raise _cannot_start(_logger_name(lg), e) from None
    if loggers:
        main_log.info("Metrics: " + "; ".join(_where(lg) for lg in loggers))


def _where(lg: Logger) -> str:
    """Where a started logger's metrics go, as a user opens them."""
    name = _logger_name(lg)
    if name == "csv":
        return f"csv {lg.experiment.metrics_file_path}"
    if name == "tensorboard":  # a resumed run continues its first launch's folder
        return f"tensorboard {lg.log_dir} (tensorboard --logdir {Path(lg.log_dir).parent})"
    if name == "mlflow":
        return f"mlflow run {lg.run_id} at {lg.experiment.tracking_uri}"  # type: ignore[attr-defined]
    return f"{name} run {lg.version}"


def log_grid(loggers: list[Logger], image: Image.Image, step: int) -> None:
    """A reconstruction grid into TensorBoard (its Images tab) and W&B (its media panel), at the
    step it was made after; the CSV and MLflow keep only the PNG in samples/."""
    array = np.asarray(image.convert("RGB"))
    for lg in loggers:
        name = _logger_name(lg)
        if name == "tensorboard":
            lg.experiment.add_image(GRID_TAG, array, global_step=step, dataformats="HWC")
        elif name == "wandb":
            lg.log_image(key=GRID_TAG, images=[array], step=step)  # type: ignore[attr-defined]


def logger_runs(loggers: list[Logger]) -> dict[str, str]:
    """{logger name: run id} of the loggers that a resumed run can continue."""
    out = {}
    for lg in loggers:
        name = _logger_name(lg)
        if name == "mlflow":
            out[name] = str(lg.run_id)  # type: ignore[attr-defined]
        elif name in ("tensorboard", "wandb") and lg.version is not None:
            out[name] = str(lg.version)
    return out


class LoggerRuns(L.Callback):
    """Records the loggers' run ids in every checkpoint (rank 0's is the one written)."""

    def on_save_checkpoint(
        self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        if trainer.is_global_zero:
            checkpoint[LOGGER_RUNS] = logger_runs(trainer.loggers)


def log_cadence(total_steps: float) -> int:
    """Optimizer steps between two logged train losses: 10, and fewer for runs under 100
    steps (every step under 20), so that a short run's loss curve still has a train line."""
    if not math.isfinite(total_steps):
        return LOG_EVERY_N_STEPS
    return max(1, min(LOG_EVERY_N_STEPS, int(total_steps) // 10))


class StepsDone(L.Callback):
    """Numbers the loggers' metrics by the optimizer steps done (`StepsDoneNumbering`), and sets
    their cadence for the run's length."""

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        for lg in trainer.loggers:
            if isinstance(lg, StepsDoneNumbering):
                lg.steps_done = lambda: trainer.global_step

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        trainer.log_every_n_steps = log_cadence(trainer.estimated_stepping_batches)


def lr_names(optimizers: list[Any]) -> list[list[str]]:
    """The series of each optimizer's parameter groups, as Lightning's LearningRateMonitor names
    them: `lr-AdamW/encoder` (a group's `name`, else `pg<N>`), `lr-AdamW` for a lone unnamed
    group, `lr-AdamW-<i>` for the i-th of several optimizers of one class."""
    kinds = [type(opt).__name__ for opt in optimizers]
    out = []
    for i, opt in enumerate(optimizers):
        base = f"lr-{kinds[i]}" + (f"-{i}" if kinds.count(kinds[i]) > 1 else "")
        groups = opt.param_groups
        if len(groups) == 1 and "name" not in groups[0]:
            out.append([base])
        else:
            out.append([f"{base}/{g.get('name', f'pg{j + 1}')}" for j, g in enumerate(groups)])
    return out


class LearningRates(L.Callback):
    """Logs each parameter group's LR at the step numbering of the losses: the LR a step used,
    at the number of optimizer steps done after it (`lr-AdamW/encoder` at 10 is the LR of the
    10th step, as `train/loss` at 10 is its loss). Lightning's LearningRateMonitor logs it at
    the steps done *before* the step (9, 19, 29 beside losses at 10, 20, 30). Placed after
    `StepBoundary`: a stop decided there makes Lightning log this batch, and the LRs too."""

    def __init__(self) -> None:
        self.names: list[str] = []  # one per parameter group, the optimizers' in order
        self.optimizers: list[Any] = []
        self.lrs: list[float] = []  # the LRs of the batch in progress, read before its step
        self.active = False  # rank 0 with a logger: the only rank that logs
        self.seen_step = -1  # global_step after the previous batch

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.seen_step = trainer.global_step
        self.active = bool(trainer.loggers) and trainer.is_global_zero
        self.optimizers = list(trainer.optimizers)
        self.names = [name for names in lr_names(self.optimizers) for name in names]

    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, idx: int
    ) -> None:
        if self.active:  # the groups read again each time: a rollback replaces them
            self.lrs = [group["lr"] for opt in self.optimizers for group in opt.param_groups]

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, idx: int
    ) -> None:
        if not self.active:
            return
        step = trainer.global_step
        stepped, self.seen_step = step != self.seen_step, step  # else accumulating gradients
        # The cadence of the losses (Lightning's own test, in steps done).
        if stepped and (step % trainer.log_every_n_steps == 0 or trainer.should_stop):
            lrs = {name: float(lr) for name, lr in zip(self.names, self.lrs, strict=True)}
            for lg in trainer.loggers:
                if isinstance(lg, StepsDoneNumbering):  # with the losses, in one write
                    lg.add(lrs, step)
                else:
                    lg.log_metrics(lrs, step=step)


def metric_callbacks(run_dir: RunDir) -> list[L.Callback]:
    """After `StepBoundary` in the trainer's callbacks (`LearningRates` reads its stop
    decision)."""
    return [
        LearningRates(),
        LoggerRuns(),
        StepsDone(),
        LossCurve(run_dir),
    ]


def no_loss_curve(logged: list[str]) -> str:
    """The warning for a run that logged neither series of the loss curve."""
    named = ", ".join(sorted(logged)) or "nothing"
    return (
        f"No loss curve: the model logged no train/loss or val/loss (it logged {named}); a "
        'LightningModule of your own logs them with self.log("train/loss", loss) in '
        'training_step and self.log("val/loss", loss, sync_dist=True) in validation_step'
    )


class LossCurve(L.Callback):
    """Renders `loss_curve.png` when fitting ends (normally or preempted)."""

    def __init__(self, run_dir: RunDir) -> None:
        self.run_dir = run_dir
        self.cut_epoch: int | None = None  # an epoch that --max_steps ended before its last batch

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # Its mean so far is logged as `train/loss_epoch` too (ae.training.model), which reads
        # as the epoch's end: the curve's top axis would count it among the epochs done.
        self.cut_epoch = None if trainer.is_last_batch else trainer.current_epoch

    def epoch_ends(self) -> list[tuple[float, int]]:
        """(step, epoch) of the run's whole epochs: not one that this run's --max_steps cut."""
        ends = read_epoch_ends(self.run_dir.metrics)
        return [(step, epoch) for step, epoch in ends if epoch != self.cut_epoch]

    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not trainer.is_global_zero or not trainer.loggers:
            return
        for lg in trainer.loggers:
            lg.save()  # loggers are finalized only after this hook
        history = read_loss_history(self.run_dir.metrics)
        if not any(math.isfinite(y) for pts in history.values() for _, y in pts):
            if not any(history.values()):  # a LightningModule of the user's, its own names
                main_log.warning(no_loss_curve(list(trainer.callback_metrics)))
            return
        path = self.run_dir.loss_curve
        guards = [cb for cb in trainer.callbacks if isinstance(cb, NonFiniteGuard)]
        marks = guards[0].events if guards else []
        loss_plot(history, path, marks=marks, epoch_ends=self.epoch_ends())
        main_log.info(f"Loss curve: {path}")
