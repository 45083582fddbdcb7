"""Metrics of a run (rank 0): CSV always, TensorBoard when installed, a loss-curve PNG at the end.

Files: `<output_dir>/metrics/<TS>/metrics.csv`, `<output_dir>/tensorboard/<TS>/`, and
`<output_dir>/loss_curve.png`. The curve covers the whole history in the run folder: a resumed
run continues the curve of the run it resumed from (a run that starts at step s replaces what
earlier runs logged from step s on, since it branched from their checkpoint).
"""

from __future__ import annotations

import csv
import importlib.util
import math
from pathlib import Path

import lightning as L
from lightning.pytorch.callbacks import LearningRateMonitor
from lightning.pytorch.loggers import CSVLogger, Logger, TensorBoardLogger

from ae.log_lines import main_log
from ae.run_dir import RunDir
from ae.training.plots import line_plot

SERIES = {"train/loss": "train loss", "val/loss": "val loss"}


def tensorboard_available() -> bool:
    return any(importlib.util.find_spec(m) is not None for m in ("tensorboard", "tensorboardX"))


def build_loggers(run_dir: RunDir, run_ts: str) -> list[Logger]:
    # CSVLogger(root, name, version) writes <root>/<name>/<version>/: run_dir.metrics/<TS>/.
    loggers: list[Logger] = [CSVLogger(run_dir.root, name=run_dir.metrics.name, version=run_ts)]
    if tensorboard_available():
        tb = TensorBoardLogger(
            run_dir.root, run_dir.tensorboard.name, version=run_ts, default_hp_metric=False
        )
        loggers.append(tb)
    return loggers


def metric_callbacks(run_dir: RunDir) -> list[L.Callback]:
    return [LearningRateMonitor(logging_interval="step"), LossCurve(run_dir)]


def read_loss_history(metrics_dir: Path) -> dict[str, list[tuple[float, float]]]:
    """{series name: [(step, value)]} over every run's metrics.csv in `metrics_dir`."""
    history: dict[str, list[tuple[float, float]]] = {name: [] for name in SERIES.values()}
    for csv_path in sorted(metrics_dir.glob("*/metrics.csv")):  # <TS> folders sort by time
        with open(csv_path, newline="") as f:
            rows = [r for r in csv.DictReader(f) if r.get("step")]
        if not rows:
            continue
        start = min(float(r["step"]) for r in rows)
        for points in history.values():
            points[:] = [p for p in points if p[0] < start]
        for row in rows:
            for key, name in SERIES.items():
                if value := row.get(key):
                    history[name].append((float(row["step"]), float(value)))
    return {k: sorted(v) for k, v in history.items() if v}


class LossCurve(L.Callback):
    """Renders `loss_curve.png` when fitting ends (normally or preempted)."""

    def __init__(self, run_dir: RunDir) -> None:
        self.run_dir = run_dir

    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not trainer.is_global_zero or not trainer.loggers:
            return
        for lg in trainer.loggers:
            lg.save()  # loggers are finalized only after this hook
        history = read_loss_history(self.run_dir.metrics)
        if not any(math.isfinite(y) for pts in history.values() for _, y in pts):
            return
        path = self.run_dir.loss_curve
        line_plot(history, path, title="loss vs optimizer step")
        main_log.info(f"Loss curve: {path}")
