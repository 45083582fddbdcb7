"""`ae` as users install it: a regular (non-editable) `pip install`, run from another folder, with
a user model from a folder of the user's own. One 2-rank launch of the installed `ae-train`, one
epoch on the demo data (no --train_shards), --debug, one dataloader worker a rank, shared by the
assertions (module-scoped): the rank module, the demo data file and the launcher all come from
the installed package; the user model's loss never uses one of its parameters (as CompressAI's
entropy bottleneck) and returns a bare tensor: --find_unused_parameters reaches DDP and the run
trains; the console says the data is the demo's; the LR is logged at the steps of the losses; the
demo run's own lines (its files split over the ranks' workers, validation, a calm console). The
refusal without the flag, and the other rules of the model check, are unit tests
(tests/training/test_model_check.py)."""

from __future__ import annotations

import csv
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.support.runs import ROOT, RunResult, shared_launches

pytestmark = [pytest.mark.slow, shared_launches(__name__)]

# tests/support/unused_param_autoencoder.py, copied to a folder of its own: nothing of the
# checkout is importable by the run
MODEL = "unused_param_autoencoder:SkipsAParameter"


@dataclass
class Installed:
    site: Path
    run: RunResult


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Installed:
    tmp = tmp_path_factory.mktemp("install")
    site = tmp / "site"
    build = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation",
         "--target", str(site), str(ROOT)],
        capture_output=True, text=True, timeout=300, cwd=tmp,
    )  # fmt: skip
    assert build.returncode == 0, build.stderr[-3000:]
    models = tmp / "my_models"
    models.mkdir()
    shutil.copy(ROOT / "tests" / "support" / "unused_param_autoencoder.py", models)
    out = tmp / "run"
    env = {**os.environ, "PYTHONPATH": f"{site}{os.pathsep}{models}",
           "AE_CACHE_DIR": str(tmp / "cache")}  # fmt: skip
    env.pop("AE_RUN_TS", None)
    env.pop("MASTER_PORT", None)
    res = subprocess.run(
        [str(site / "bin" / "ae-train"), f"--output_dir={out}", f"--model={MODEL}",
         "--find_unused_parameters", "--max_epochs=1", "--batch_size=8", "--num_workers=1",
         "--checkpointing_period=0", "--logger=csv", "--stall_timeout=60", "--debug=true"],
        capture_output=True, text=True, timeout=240, cwd=tmp, env=env,
    )  # fmt: skip
    return Installed(site, RunResult(res.returncode, res.stdout + res.stderr, out / "logs"))


def test_ae_train_from_a_regular_install(installed: Installed) -> None:
    """The console script trains with nothing from the checkout: the rank module, the demo data
    file and the launcher all come from the installed package."""
    site, run = installed.site, installed.run
    assert not (site / "ae" / "__editable__").exists()
    assert (site / "ae" / "rank" / "train.py").is_file()
    assert run.returncode == 0, run.output[-3000:]
    for rank in (0, 1):
        (log,) = run.logs.glob(f"debug_rank{rank}_*.log")
        where = re.search(r"ae=\S+ \((.+)\)", log.read_text())
        assert where and Path(where[1]) == site / "ae", where


def test_a_parameter_the_loss_never_uses_trains_on_2_ranks_with_find_unused_parameters(
    installed: Installed,
) -> None:
    run = installed.run
    assert run.returncode == 0, run.output
    assert "parameters that were not used" not in run.output
    assert "Training finished at step 93" in run.text("train_*"), run.output  # 1,500 // 16


def test_the_console_says_the_data_is_the_demo_digits_when_no_train_shards_is_given(
    installed: Installed,
) -> None:
    run = installed.run
    assert "train (the demo digits: no --train_shards given)" in run.output, run.output


def test_the_lr_is_logged_at_the_steps_of_the_losses(installed: Installed) -> None:
    (metrics,) = (installed.run.logs.parent / "metrics").glob("*/metrics.csv")
    with open(metrics, newline="") as f:
        rows = list(csv.DictReader(f))
    losses = [int(r["step"]) for r in rows if r.get("train/loss")]
    lrs = [int(r["step"]) for r in rows if r.get("lr-AdamW/encoder")]
    assert losses and lrs == losses, (lrs, losses)


def test_the_demo_run_splits_its_files_validates_and_keeps_the_console_calm(
    installed: Installed,
) -> None:
    run = installed.run
    text = run.text("debug_rank1_*.log")
    assert re.search(r"\[Rank 1/2 Worker 0/1\] Processing [1-4]/4 files from train_shards", text)
    assert "EPOCH 0 VALIDATION END" in text
    # A calm console with --debug: c10d's C++ lines (`[I1123 ... TCPStore.cpp...]`) of every
    # rank, the run-timestamp handshake's included, are in the native logs.
    assert not re.search(r"^\[?[IWE]\d{4} \d\d:\d\d", run.output, re.M), run.output
    assert "[c10d" in run.text("native_rank0_*.log") and "[c10d" in run.text("native_rank1_*.log")
