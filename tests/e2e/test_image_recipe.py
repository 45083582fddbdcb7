"""The latent-diffusion recipe end to end on real photographs at 64 px, 2 gloo ranks: LPIPS and a
PatchGAN discriminator from step 2 (`--disc_start=2`), through validation, resumed exactly, and
encoded; a missing weights file stops the launcher in seconds. One set of launches, shared by the
assertions (module-scoped): an uninterrupted 2-epoch run, and the same run as 1 epoch resumed to 2.
The uninterrupted run also reports rFID (`--fid_weights`): its state must still equal the resumed
one's. The weights files are made here (a random VGG16 in torchvision's format, random LPIPS
heads, a random FID Inception in pytorch-fid's)."""

from __future__ import annotations

import csv
import re
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from ae.cli.shards import main as ae_shards
from ae.config.weight_files import FID_FILE, HEADS_FILE, VGG16_FILE
from bench.real_images import mixed_collection
from tests.support.inception_weights import random_inception
from tests.support.resumes import assert_resumed
from tests.support.runs import ROOT, RunResult, run_launcher, shared_launches
from tests.support.weights import random_heads, random_vgg16, save

pytestmark = [pytest.mark.slow, shared_launches(__name__)]

RECIPE = ["--image_size=64", "--batch_size=4", "--num_workers=1", "--model=conv",
          "--hidden_dim=64", "--latent_dim=32", "--loss=l1", "--perceptual_weight=1.0",
          "--disc_weight=0.5", "--disc_start=2", "--disc_channels=16", "--lr_scheduler=constant",
          "--warmup_steps=0", "--checkpointing_period=0",
          "--log_every_n_train_batches=1"]  # fmt: skip


@dataclass
class Runs:
    data: Path
    weights: Path
    whole: RunResult
    first: RunResult
    resumed: RunResult
    whole_dir: Path
    split_dir: Path


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Runs:
    tmp = tmp_path_factory.mktemp("recipe")
    photos = mixed_collection(tmp / "photos")
    assert ae_shards(["write", str(tmp / "photos"), str(tmp / "data"), "--per_shard", "10"]) == 0
    assert len(photos) == 35
    weights = tmp / "weights"
    save(random_vgg16(), weights / VGG16_FILE)
    save(random_heads(), weights / HEADS_FILE)
    save(random_inception(), weights / FID_FILE)
    args = [f"--train_shards={tmp / 'data'}", f"--perceptual_weights={weights}", *RECIPE]
    whole_dir, split_dir = tmp / "whole", tmp / "split"
    whole = run_launcher(
        [*args, "--max_epochs=2", f"--fid_weights={weights}"], whole_dir, timeout=900
    )
    assert whole.returncode == 0, whole.output
    first = run_launcher([*args, "--max_epochs=1"], split_dir, timeout=900)
    assert first.returncode == 0, first.output
    resumed = run_launcher(
        [*args, "--max_epochs=2", "--resume_from_checkpoint=last"], split_dir, timeout=900
    )
    assert resumed.returncode == 0, resumed.output
    return Runs(tmp / "data", weights, whole, first, resumed, whole_dir, split_dir)


def test_trains_with_the_recipe_through_validation_on_two_ranks(runs: Runs) -> None:
    main = runs.whole.text("train_*.log")
    assert "PatchGAN discriminator (" in main and "from step 2" in main
    assert f"LPIPS: VGG16 from {runs.weights / VGG16_FILE}" in main
    # 27 photos for training // (2 ranks x 4) = 3 steps an epoch: the discriminator runs from
    # step 2, every rank reports its own view of it in its own log
    for rank in (0, 1):
        text = runs.whole.text(f"debug_rank{rank}_*.log")
        steps = [int(line.split("GAN step ")[1].split(":")[0])
                 for line in text.splitlines() if "GAN step " in line]  # fmt: skip
        assert steps and min(steps) == 2, steps
    (metrics,) = (runs.whole_dir / "metrics").glob("*/metrics.csv")
    rows = list(csv.DictReader(metrics.open()))
    columns = set(rows[0])
    for name in ("val/loss", "val/lpips", "val/psnr", "val/ssim", "train/perceptual",
                 "train/g_loss", "train/d_loss", "train/d_weight", "train/d_accuracy"):  # fmt: skip
        assert name in columns, name
    assert [float(r["val/lpips"]) for r in rows if r["val/lpips"]]
    # rFID over the validation photos of both ranks, at each epoch's validation: in
    # the loggers and in the train log's epoch summaries
    assert f"FID Inception v3 from {runs.weights / FID_FILE}" in main
    rfid = [float(r["val/rfid"]) for r in rows if r.get("val/rfid")]
    assert len(rfid) == 2 and all(v > 0 for v in rfid), rfid
    for epoch in (0, 1):
        (line,) = [x for x in main.splitlines() if f"Epoch {epoch} done:" in x]
        assert "val/rfid=" in line, line
    # the per-rank series, from each rank's stats file: no collective
    assert {"gan/d_accuracy/rank0", "gan/d_weight/rank0"} <= columns
    assert any(c.startswith("gan/") and c.endswith("/rank1") for c in columns), sorted(columns)
    grids = sorted((runs.whole_dir / "samples").glob("*.png"))
    assert grids, "a reconstruction grid at each epoch's end"


def _state(path: Path) -> dict:
    return torch.load(path, weights_only=True, map_location="cpu")


def test_resumes_exactly_with_both_parameter_groups(runs: Runs) -> None:
    assert "Resumed from" in runs.resumed.text("train_*.log")
    # the conv model's own lines, trained then resumed (tests/e2e/test_models.py has the others)
    first = runs.first.text("train_*.log")
    assert re.search(r"Model: conv, [\d,]+ parameters, latent ", first)
    (summary,) = re.findall(r"Epoch 0 done: .*", first)
    assert all(re.search(rf"val/{m}=-?[\d.]+", summary) for m in ("mse", "psnr", "ssim"))
    assert_resumed(runs.resumed, at=3, to=6)
    psnr = []
    for path in sorted((runs.split_dir / "metrics").glob("*/metrics.csv")):  # one per launch
        with open(path, newline="") as f:
            psnr += [float(r["val/psnr"]) for r in csv.DictReader(f) if r.get("val/psnr")]
    assert len(psnr) == 2 and all(0 < p < 100 for p in psnr)  # one per epoch, both launches
    # the epoch-end grids, without --sample_period
    assert sorted(p.name for p in (runs.split_dir / "samples").glob("*.png")) == [
        "step_00000003.png",
        "step_00000006.png",
    ]
    a = _state(runs.whole_dir / "checkpoints" / "last.ckpt")
    b = _state(runs.split_dir / "checkpoints" / "last.ckpt")
    assert a["global_step"] == b["global_step"] == 6
    assert any(k.startswith("discriminator.") for k in a["state_dict"])
    for k, v in a["state_dict"].items():
        assert torch.equal(v, b["state_dict"][k]), k
    (opt_a,), (opt_b,) = a["optimizer_states"], b["optimizer_states"]
    names = [g["name"] for g in opt_a["param_groups"]]
    assert names[-1] == "discriminator" and names == [g["name"] for g in opt_b["param_groups"]]
    assert opt_a["param_groups"][-1]["betas"] == (0.5, 0.9)
    for i, state in opt_a["state"].items():
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(state[key], opt_b["state"][i][key]), (i, key)


def test_ae_encode_works_on_its_checkpoint(runs: Runs, tmp_path: Path) -> None:
    out = tmp_path / "latents"
    ckpt = runs.split_dir / "checkpoints" / "last.ckpt"
    enc = subprocess.run(
        [sys.executable, "-m", "ae.cli.encode", str(ckpt), str(runs.data), str(out),
         "--devices=1", "--batch_size=8"],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert enc.returncode == 0, enc.stdout + enc.stderr
    assert sorted(p.name for p in out.glob("*.tar")) == sorted(
        p.name for p in runs.data.glob("*.tar")
    )


def test_missing_weights_stop_the_launcher_in_seconds(runs: Runs, tmp_path: Path) -> None:
    empty = tmp_path / "no-weights"
    empty.mkdir()
    start = time.monotonic()
    res = run_launcher(
        [f"--train_shards={runs.data}", f"--perceptual_weights={empty}", *RECIPE,
         "--max_epochs=1"], tmp_path / "run",
    )  # fmt: skip
    elapsed = time.monotonic() - start
    assert res.returncode == 2, res.output
    assert elapsed < 30, elapsed  # the launcher alone, a loaded machine: well under a minute
    assert f"LPIPS needs 2 file(s) missing from {empty}" in res.output
    assert f"curl -L --create-dirs -o {empty / VGG16_FILE}" in res.output
    assert f"lpips/weights/v0.1/vgg.pth -d {empty}" in res.output
    assert not list((tmp_path / "run").glob("logs/debug_rank*"))  # no rank ever started
