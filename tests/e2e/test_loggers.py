"""The loggers people look at, on a real 2-rank run: TensorBoard (read back with its own event
reader) with the per-rank series and the grids, an offline W&B run and an MLflow file store that
hold the loss, steps numbered as the checkpoints are, and a resume that continues all three runs."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest
from PIL import Image

from tests.support.runs import RunResult

pytestmark = pytest.mark.slow

wandb = pytest.importorskip(
    "wandb", reason="the wandb extra is not installed (pip install -e '.[wandb]')"
)
pytest.importorskip(
    "mlflow", reason="the mlflow extra is not installed (pip install -e '.[mlflow]')"
)

from mlflow import MlflowClient  # noqa: E402
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator  # noqa: E402

from tests.support.wandb_offline import read_offline_run  # noqa: E402

SERIES = ("own_ms_per_step", "data_wait_pct", "straggler_score", "rss_mb")


def _tensorboard(folder: Path) -> EventAccumulator:
    events = EventAccumulator(str(folder), size_guidance={"scalars": 0, "images": 0})
    events.Reload()
    return events


def test_tensorboard_wandb_mlflow_and_a_resume_that_continues_them(
    launch, make_shards, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    train = make_shards([64, 64], kind="png", name="train")  # 4 batches of 16 per rank
    val = make_shards([32], kind="png", name="val")
    args = [f"--train_shards={train}", f"--val_shards={val}", "--batch_size=16",
            "--num_workers=1", "--max_epochs=-1", "--checkpointing_period=1000",
            "--logger=csv,tensorboard,wandb,mlflow", "--experiment=ae-test",
            "--straggler_window=5", "--stall_timeout=30"]  # fmt: skip
    # Rank 1 40 ms slower per step: its own time, and its score, stand out in its series.
    env = {"WANDB_MODE": "offline", "AE_FAULT": "slow@train:rank=1:ms=40"}
    first: RunResult = launch([*args, "--max_steps=60"], env=env)
    assert first.returncode == 0, first.output
    out = first.logs.parent

    # TensorBoard: the losses, numbered in steps done, the per-rank series of both ranks, grids
    (tb_dir,) = (out / "tensorboard").iterdir()
    events = _tensorboard(tb_dir)
    scalars = set(events.Tags()["scalars"])
    for series in SERIES:
        assert {f"{series}/rank0", f"{series}/rank1"} <= scalars, sorted(scalars)
    assert [e.step for e in events.Scalars("train/loss")] == list(range(6, 61, 6))  # cadence 6
    assert [e.step for e in events.Scalars("val/loss")] == [4, 8, 12, 16, 20, 24, 28, 32, 36,
                                                             40, 44, 48, 52, 56, 60]  # fmt: skip
    slow = [e.value for e in events.Scalars("own_ms_per_step/rank1")]
    fast = [e.value for e in events.Scalars("own_ms_per_step/rank0")]
    assert slow[-1] > fast[-1] + 20  # rank 1's own 40 ms more per step shows as its own
    assert events.Scalars("straggler_score/rank1")[-1].value > 1.3
    assert "samples/reconstructions" in events.Tags()["images"]

    # The CSV and the loss curve count steps the same way
    (metrics_csv,) = (out / "metrics").glob("*/metrics.csv")
    with open(metrics_csv, newline="") as f:
        rows = list(csv.DictReader(f))
    assert [int(r["step"]) for r in rows if r.get("train/loss")] == list(range(6, 61, 6))
    with Image.open(out / "loss_curve.png") as img:
        assert img.format == "PNG" and img.size == (720, 420)

    # W&B, offline: one run holding the loss at the same steps
    (wandb_file,) = (out / "wandb").glob("offline-run-*/*.wandb")
    run_id, history = read_offline_run(wandb_file)
    wandb_steps = [r["trainer/global_step"] for r in history if "train/loss" in r]
    assert wandb_steps == list(range(6, 61, 6))

    # MLflow, a file store under the run folder: one run holding the loss
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    client = MlflowClient(tracking_uri=(out / "mlruns").resolve().as_uri())
    (experiment,) = [e for e in client.search_experiments() if e.name == "ae-test"]
    (run,) = client.search_runs([experiment.experiment_id])
    steps = [m.step for m in client.get_metric_history(run.info.run_id, "train/loss")]
    assert sorted(steps) == list(range(6, 61, 6))

    # The resume continues the same three runs, its steps going on from the checkpoint's; a
    # changed flag (the LR) changes a hyperparameter that MLflow already holds: no failure. On 1
    # rank (the loggers are rank 0's; a process less): the checkpoint is at an epoch's end.
    resumed = launch(
        [*args, "--max_steps=66", "--resume_from_checkpoint=last", "--learning_rate=2e-3",
         "--devices=1"], env=env,
    )  # fmt: skip
    assert resumed.returncode == 0, resumed.output
    assert [p.name for p in (out / "tensorboard").iterdir()] == [tb_dir.name]
    steps = [e.step for e in _tensorboard(tb_dir).Scalars("train/loss")]
    assert steps[:10] == list(range(6, 61, 6)) and steps[-1] == 66 and steps == sorted(steps)
    wandb_files = sorted((out / "wandb").glob("offline-run-*/*.wandb"))
    assert len(wandb_files) == 2
    second_id, second = read_offline_run(wandb_files[-1])
    assert second_id == run_id
    assert [r["trainer/global_step"] for r in second if "train/loss" in r][-1] == 66
    (again,) = client.search_runs([experiment.experiment_id])
    assert again.info.run_id == run.info.run_id
    steps = sorted(m.step for m in client.get_metric_history(run.info.run_id, "train/loss"))
    assert steps[-1] == 66 and steps[:10] == list(range(6, 61, 6))
