"""The loggers' cadence, the LR's step numbering and the per-rank series read from heartbeats."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import lightning as L
import pytest
import torch
from loguru import logger as loguru_logger

from ae.config import ConfigError, ModelConfig, OptimConfig, parse_config
from ae.data.decoding.decode import InputSpec
from ae.log_lines import HEARTBEAT_FILE
from ae.run_paths import RunDir
from ae.training.loss_curve import LossCurve
from ae.training.lr import lr_factor
from ae.training.metrics import (
    LearningRates,
    NumberedCSVLogger,
    StepsDone,
    build_loggers,
    log_cadence,
    start_loggers,
)
from ae.training.model import AutoEncoder
from ae.training.rank_series import rank_values, read_heartbeats


def test_short_runs_log_often_enough_for_a_train_line() -> None:
    assert [log_cadence(n) for n in (3, 19, 20, 55, 99, 100, 10_000)] == [1, 1, 2, 5, 9, 10, 10]
    assert log_cadence(float("inf")) == 10


def _beat(rank: int, own_ms: float, data_ms: float, rss: float, workers: list[float]) -> dict:
    window = {"window_s": 10.0, "steps": 20, "step_ms": own_ms + 5, "own_ms": own_ms,
              "data_ms": data_ms, "compute_ms": own_ms - data_ms, "sync_ms": 5.0}  # fmt: skip
    return {
        "rank": rank, "state": "running", "rss_mb": rss,
        "workers": [{"pid": 1, "rss_mb": w} for w in workers],
        "timing": {"recent": window, "epoch": window}, "data_workers": [],
    }  # fmt: skip


def test_rank_values_from_heartbeat_files(tmp_path: Path) -> None:
    ts = "20260101_000000"
    for beat in (_beat(0, 10.0, 2.0, 300.0, [100.0]), _beat(1, 20.0, 15.0, 310.0, [])):
        path = tmp_path / HEARTBEAT_FILE.format(rank=beat["rank"], ts=ts)
        path.write_text(json.dumps(beat))
    (tmp_path / HEARTBEAT_FILE.format(rank=2, ts=ts)).write_text("{torn")  # being replaced
    values = rank_values(read_heartbeats(tmp_path, ts))
    assert values == {
        "own_ms_per_step/rank0": 10.0, "data_wait_pct/rank0": pytest.approx(20.0),
        "own_ms_per_step/rank1": 20.0, "data_wait_pct/rank1": pytest.approx(75.0),
        "straggler_score/rank0": 0.5, "straggler_score/rank1": 2.0,
        "rss_mb/rank0": 400.0, "rss_mb/rank1": 310.0,
    }  # fmt: skip


def test_a_logger_that_cannot_start_is_a_config_error(tmp_path: Path) -> None:
    """Raised in the ranks before training: one message naming the logger, exit code 2 (the
    launcher's handling of a rank's ConfigError: tests/e2e/test_runs.py)."""
    pytest.importorskip(
        "mlflow", reason="the mlflow extra is not installed: pip install -e '.[mlflow]'"
    )
    cfg = parse_config(
        [f"--output_dir={tmp_path}", "--logger=csv,mlflow", "--mlflow_tracking_uri=nosuch://x"]
    )
    with pytest.raises(ConfigError) as err:
        build_loggers(cfg.obs, cfg.run.dir, "20260101_000000", {})
    (problem,) = err.value.problems
    assert problem.startswith("logger: mlflow cannot start: ") and "nosuch://x" in problem
    assert err.value.exit_code == 2


def test_wandb_that_cannot_start_says_how_to_log_offline(monkeypatch: pytest.MonkeyPatch) -> None:
    """W&B without a login (ranks have no terminal: its prompt is skipped) or without its
    server stops the run with W&B's words alone; they do not say that WANDB_MODE=offline runs
    without either. The same failure offline is not told to go offline."""
    from ae.training.metrics import _cannot_start

    monkeypatch.delenv("WANDB_MODE", raising=False)
    error = _cannot_start("wandb", RuntimeError("api_key not configured (no-tty). call login"))
    assert error.problems == [
        "logger: wandb cannot start: RuntimeError: api_key not configured (no-tty). call login; "
        "to log without a W&B login or network, set WANDB_MODE=offline (the run stays in "
        "<output_dir>/wandb/; `wandb sync` uploads it later)"
    ]
    monkeypatch.setenv("WANDB_MODE", "offline")
    assert _cannot_start("wandb", OSError("disk")).problems == [
        "logger: wandb cannot start: OSError: disk"
    ]
    assert "WANDB_MODE" not in _cannot_start("mlflow", OSError("x")).problems[0]


def test_started_loggers_say_where_their_metrics_go(tmp_path: Path) -> None:
    """One console line names the CSV file and the TensorBoard folder (with the command that
    opens it); a resumed TensorBoard run continues its first launch's folder."""
    cfg = parse_config([f"--output_dir={tmp_path}", "--logger=csv,tensorboard"])
    lines: list[str] = []
    sink = loguru_logger.add(lines.append, format="{message}")
    try:
        start_loggers(build_loggers(cfg.obs, cfg.run.dir, "20260101_000000", {}))
        resumed = {"tensorboard": "20251231_000000"}
        start_loggers(build_loggers(cfg.obs, cfg.run.dir, "20260102_000000", resumed))
    finally:
        loguru_logger.remove(sink)
    first, second = (ln.strip() for ln in lines if ln.startswith("Metrics: "))
    assert first == (
        f"Metrics: csv {tmp_path}/metrics/20260101_000000/metrics.csv; tensorboard "
        f"{tmp_path}/tensorboard/20260101_000000 (tensorboard --logdir {tmp_path}/tensorboard)"
    )
    assert f"csv {tmp_path}/metrics/20260102_000000/metrics.csv" in second
    assert f"tensorboard {tmp_path}/tensorboard/20251231_000000 " in second
    assert "loss_curve" not in first


def test_loggers_without_csv_say_that_no_loss_curve_is_drawn(tmp_path: Path) -> None:
    """`--logger=tensorboard` (or wandb, mlflow alone) ended without loss_curve.png and without
    a word: the curve is drawn from the CSV logger's metrics.csv."""
    cfg = parse_config([f"--output_dir={tmp_path}", "--logger=tensorboard"])
    lines: list[str] = []
    sink = loguru_logger.add(lines.append, format="{message}")
    try:
        start_loggers(build_loggers(cfg.obs, cfg.run.dir, "20260101_000000", {}))
    finally:
        loguru_logger.remove(sink)
    (line,) = (ln.strip() for ln in lines if ln.startswith("Metrics: "))
    assert line.endswith("; no loss_curve.png: it is drawn from the csv logger (--logger=csv,...)")


def test_a_resumed_tensorboard_run_drops_the_points_after_its_checkpoint(tmp_path: Path) -> None:
    """An attempt logged steps 1-8 and died; the run resumed from the checkpoint of step 5
    logs 6-8 again (other values): TensorBoard shows each step once, the resumed run's."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    cfg = parse_config([f"--output_dir={tmp_path}", "--logger=tensorboard"])
    (first,) = build_loggers(cfg.obs, cfg.run.dir, "20260101_000000", {})
    for step in range(1, 9):
        first.log_metrics({"train/loss": float(step)}, step)
    first.finalize("failed")
    runs = {"tensorboard": "20260101_000000"}
    (resumed,) = build_loggers(cfg.obs, cfg.run.dir, "20260102_000000", runs, resumed_step=5)
    for step in range(6, 9):
        resumed.log_metrics({"train/loss": 10.0 * step}, step)
    resumed.finalize("success")
    events = EventAccumulator(str(tmp_path / "tensorboard" / "20260101_000000"))
    events.Reload()
    points = [(e.step, e.value) for e in events.Scalars("train/loss")]
    assert points == [(1, 1.0), (2, 2.0), (3, 3.0), (4, 4.0), (5, 5.0),
                      (6, 60.0), (7, 70.0), (8, 80.0)]  # fmt: skip


def test_the_lr_is_logged_at_the_steps_of_the_losses_with_the_lr_that_step_used(
    tmp_path: Path,
) -> None:
    """TensorBoard showed the LR at 9/19/29 beside losses at 10/20/30 (Lightning's monitor logs
    before the step): now both at the steps done, the LR the step trained with; the validation
    and epoch metrics too (Lightning hands them over at the steps done minus one as well)."""
    optim = OptimConfig(learning_rate=1e-2, warmup_steps=5, lr_scale="none", decoder_lr_mult=0.5)
    model = AutoEncoder(InputSpec("vector", (8,)), ModelConfig(hidden_dim=16, latent_dim=2), optim)
    data = torch.utils.data.DataLoader(torch.rand(64, 8), batch_size=2)  # 32 batches an epoch
    trainer = L.Trainer(
        max_steps=40, accelerator="cpu", logger=NumberedCSVLogger(tmp_path, name="m", version="v"),
        callbacks=[LearningRates(), StepsDone()], enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
        val_check_interval=16, limit_val_batches=1,
    )  # fmt: skip
    trainer.fit(model, data, torch.utils.data.DataLoader(torch.rand(4, 8), batch_size=2))
    with open(tmp_path / "m" / "v" / "metrics.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert sorted({int(r["step"]) for r in rows if r.get("val/loss")}) == [16, 32]
    assert sorted(int(r["step"]) for r in rows if r.get("train/loss_epoch")) == [32, 40]
    loss_steps = sorted(int(float(r["step"])) for r in rows if r.get("train/loss"))
    lrs = {int(float(r["step"])): r for r in rows if r.get("lr-AdamW/encoder")}
    assert loss_steps == list(range(4, 41, 4))  # a 40-step run logs every 4 steps
    assert sorted(lrs) == loss_steps
    for step, row in lrs.items():
        used = 1e-2 * lr_factor(step - 1, 5, 40, "cosine")  # the step-th step: index step - 1
        assert float(row["lr-AdamW/encoder"]) == pytest.approx(used)
        assert float(row["lr-AdamW/decoder"]) == pytest.approx(used * 0.5)


def test_ae_metrics_go_with_lightnings_at_their_step_or_on_their_own(tmp_path: Path) -> None:
    """The LRs join the losses' write at the same step (one CSV row); at a step where Lightning
    hands over nothing they are still written, at their own step, by the next save."""
    logger = NumberedCSVLogger(tmp_path, name="m", version="v")
    steps = iter([10, 20])
    logger.steps_done = lambda: next(steps)
    logger.add({"lr": 0.1}, 10)
    logger.log_metrics({"train/loss": 1.0})  # Lightning's handover at step 10
    logger.add({"lr": 0.2}, 15)  # no handover at 15
    logger.log_metrics({"train/loss": 2.0})  # at 20: the LR of 15 first, on its own
    logger.add({"lr": 0.3}, 25)
    logger.save()
    with open(tmp_path / "m" / "v" / "metrics.csv", newline="") as f:
        rows = [{k: v for k, v in r.items() if v} for r in csv.DictReader(f)]
    assert rows == [
        {"lr": "0.1", "train/loss": "1.0", "step": "10"},
        {"lr": "0.2", "step": "15"},
        {"train/loss": "2.0", "step": "20"},
        {"lr": "0.3", "step": "25"},
    ]


def test_a_run_that_logs_neither_loss_series_says_why_it_has_no_curve(
    tmp_path: Path, records: list[tuple[str, str]]
) -> None:
    # Was: a LightningModule of the user's logging `train_loss` got no loss_curve.png, without a
    # word (found by the own-model walkthrough)
    from types import SimpleNamespace

    csv_logger = NumberedCSVLogger(tmp_path, name="metrics", version="20261128_101010")
    trainer = SimpleNamespace(
        is_global_zero=True, loggers=[csv_logger], callbacks=[],
        callback_metrics={"train_loss": torch.tensor(0.4)},
    )  # fmt: skip
    LossCurve(RunDir(tmp_path)).on_fit_end(trainer, None)  # type: ignore[arg-type]
    assert [m for _, m in records if m.startswith("No loss curve")] == [
        "No loss curve: the model logged no train/loss or val/loss (it logged train_loss); a "
        'LightningModule of your own logs them with self.log("train/loss", loss) in '
        'training_step and self.log("val/loss", loss, sync_dist=True) in validation_step'
    ]
    assert not RunDir(tmp_path).loss_curve.exists()
