"""End-to-end, one 2-rank launch of one epoch on the demo data (no --train_shards), --debug, one
dataloader worker a rank, with a user model whose loss never uses one of its parameters (as
CompressAI's entropy bottleneck) and returns a bare tensor: --find_unused_parameters reaches DDP
and the run trains; the console says the data is the demo's; the LR is logged at the steps of the
losses; the demo run's own lines (its files split over the worker, validation, a calm console).
The refusal without the flag, and the other rules of the model check, are unit tests
(tests/training/test_model_check.py)."""

from __future__ import annotations

import csv
import re

import pytest

from tests.support.runs import RunResult, run_launcher, shared_launches

pytestmark = [pytest.mark.slow, shared_launches(__name__)]

MODEL = "tests.support.unused_param_autoencoder:SkipsAParameter"


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> RunResult:
    out = tmp_path_factory.mktemp("unused") / "run"
    return run_launcher(
        [f"--model={MODEL}", "--find_unused_parameters", "--max_epochs=1", "--batch_size=8",
         "--num_workers=1", "--checkpointing_period=0", "--logger=csv", "--stall_timeout=60",
         "--debug=true"],
        out,
    )  # fmt: skip


def test_a_parameter_the_loss_never_uses_trains_on_2_ranks_with_find_unused_parameters(
    run: RunResult,
) -> None:
    assert run.returncode == 0, run.output
    assert "parameters that were not used" not in run.output
    assert "Training finished at step 93" in run.text("train_*"), run.output  # 1,500 // 16


def test_the_console_says_the_data_is_the_demo_digits_when_no_train_shards_is_given(
    run: RunResult,
) -> None:
    assert "train (the demo digits: no --train_shards given)" in run.output, run.output


def test_the_lr_is_logged_at_the_steps_of_the_losses(run: RunResult) -> None:
    (metrics,) = (run.logs.parent / "metrics").glob("*/metrics.csv")
    with open(metrics, newline="") as f:
        rows = list(csv.DictReader(f))
    losses = [int(r["step"]) for r in rows if r.get("train/loss")]
    lrs = [int(r["step"]) for r in rows if r.get("lr-AdamW/encoder")]
    assert losses and lrs == losses, (lrs, losses)


def test_the_demo_run_splits_its_files_validates_and_keeps_the_console_calm(run: RunResult) -> None:
    text = run.text("debug_rank1_*.log")
    assert re.search(r"\[Rank 1/2 Worker 0/1\] Processing [1-4]/4 files from train_shards", text)
    assert "EPOCH 0 VALIDATION END" in text
    # A calm console with --debug: c10d's C++ lines (`[I1123 ... TCPStore.cpp...]`) of every
    # rank, the run-timestamp handshake's included, are in the native logs.
    assert not re.search(r"^\[?[IWE]\d{4} \d\d:\d\d", run.output, re.M), run.output
    assert "[c10d" in run.text("native_rank0_*.log") and "[c10d" in run.text("native_rank1_*.log")
