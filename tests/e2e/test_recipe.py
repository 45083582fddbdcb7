"""End-to-end training recipe on 2 gloo ranks: LR scaling, validation cadence, checkpoints,
sampling with an injected OOM, SIGTERM preemption and resume."""

from __future__ import annotations

import csv
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml
from PIL import Image

from ae.config import parse_config
from ae.diagnose.log_files import find_run
from ae.diagnose.report import diagnose
from ae.training.lr import lr_factor
from tests.support.runs import ROOT, run_launcher

pytestmark = pytest.mark.slow


def _lrs(text: str) -> dict[int, float]:
    """{step: lr} from the `Training step K, loss=X, lr=Y` lines of a --debug rank log."""
    return {
        int(s): float(v) for s, v in re.findall(r"Training step (\d+), loss=\S+, lr=([^,]+)", text)
    }


def test_recipe_run(launch, make_shards, tmp_path: Path) -> None:
    """YAML `learning_rate: 1e-4`, 2 ranks, linear scaling; accumulation; validation every 3
    optimizer steps; checkpoint and sampling on the same steps; the first sampling OOMs."""
    train = make_shards([40, 40, 30, 20], kind="png", name="train")
    val = make_shards([24], kind="png", name="val")
    config = tmp_path / "recipe.yaml"
    config.write_text(
        "learning_rate: 1e-4\nlr_scale: linear\nbatch_size: 8\ngradient_accumulation_steps: 2\n"
        "warmup_steps: 2\nmax_steps: 10\nval_interval: 3\ncheckpointing_period: 2\n"
        "checkpoints_total_limit: 2\nsample_period: 2\nsample_batch_size: 4\n"
        "num_sample_batches: 2\nnum_workers: 1\n"
    )
    res = launch(
        [f"--config={config}", f"--train_shards={train}", f"--val_shards={val}", "--debug=true"],
        env={"AE_FAULT": "oom@sampling"},
    )
    assert res.returncode == 0, res.output
    main = res.text("train_*.log")
    out = res.logs.parent

    # LR and batch, as the train log states them
    assert "Base LR: 0.0001, Effective LR (scaled by 2, linear): 0.0002" in main
    assert "Effective batch: 8 per device x 2 ranks x 2 accumulation = 32 samples" in main
    assert "Setup: distributed, world size 2 (1 node(s)), rank 0, local rank 0, device cpu" in main
    rank0 = res.text("debug_rank0_*.log")
    lrs = _lrs(rank0)
    for step in (1, 2, 5, 9):  # LR after `step` optimizer steps = the schedule at that step
        assert lrs[step] == pytest.approx(2e-4 * lr_factor(step, 2, 10, "cosine"), rel=2e-3)

    # validation every 3 optimizer steps and at each epoch end (4 optimizer steps per epoch)
    validated = {int(g) for g in re.findall(r"Validation step 1, .*\(global step (\d+)\)", rank0)}
    assert validated == {3, 4, 6, 8, 9}
    assert re.search(r"Epoch 0 done: .*val/loss=", main)

    # checkpoints: every 2 steps, newest 2 kept, plus last and best; config inside and beside
    ckpt = out / "checkpoints"
    names = sorted(p.name for p in ckpt.iterdir())
    assert names == ["best.ckpt", "last.ckpt", "step-00000008.ckpt", "step-00000010.ckpt"]
    last = torch.load(ckpt / "last.ckpt", weights_only=False)
    assert last["global_step"] == 10 and last["ae_config"]["learning_rate"] == 1e-4
    saved_cfg = parse_config([f"--config={out / 'config.yaml'}"])
    assert saved_cfg.obs.sample_period == 2 and saved_cfg.optim.learning_rate == 1e-4
    for rank in (0, 1):
        text = res.text(f"debug_rank{rank}_*.log")
        starts = re.findall(r"CHECKPOINT SAVE START ========== step (\d+) \(periodic\)", text)
        assert starts == ["2", "4", "6", "8", "10"]
        assert len(re.findall(r"CHECKPOINT SAVE END ========== step \d+ .*s$", text, re.M)) >= 5
        # same step: the checkpoint is saved, then sampling runs
        assert text.index("CHECKPOINT SAVE END ========== step 2 ") < text.index(
            "SAMPLING START ========== step 2:"
        )
        # the injected OOM: logged with memory, batch halved, later samplings succeed
        assert re.search(
            r"SAMPLING OOM at step 2 with batch 4 per device: OutOfMemoryError: .*memory at "
            r"failure rss=\d+MB[^;]*, after freeing rss=\d+MB[^;]*; sampling batch halved to 2",
            text,
        )
        assert len(re.findall(r"SAMPLING START ==========", text)) == 5
        ends = re.findall(r"SAMPLING END ========== step (\d+): reconstruction loss=", text)
        assert ends == ["4", "6", "8", "10"]
        assert "SAMPLING START ========== step 4: 2 batch(es) x 2 per device, memory rss=" in text
    assert len(re.findall(r"WARNING .*SAMPLING OOM", main)) == 2  # one per rank

    # rank 0's reconstruction grids: 4 inputs over their reconstructions, 8x8 scaled to 64x64
    grids = sorted((out / "samples").glob("*.png"))
    assert [p.name for p in grids] == [f"step_{s:08d}.png" for s in (4, 6, 8, 10)]
    with Image.open(grids[-1]) as img:
        assert img.size == (34 + 4 * 68 + 4, 2 * 64 + 3 * 4 + 4)

    # metrics: CSV of this run, and the loss curve
    (metrics_csv,) = (out / "metrics").glob("*/metrics.csv")
    with open(metrics_csv) as f:
        rows = list(csv.DictReader(f))
    assert any(r.get("val/loss") for r in rows) and any(r.get("lr-AdamW/encoder") for r in rows)
    # A 10-step run logs every step (metrics.log_cadence), numbered as steps done (1..10, the
    # checkpoint's numbering); validation at the steps it ran after.
    assert [r["step"] for r in rows if r.get("train/loss")] == [str(s) for s in range(1, 11)]
    assert sorted({int(r["step"]) for r in rows if r.get("val/loss")}) == [3, 4, 6, 8, 9]
    assert (out / "loss_curve.png").stat().st_size > 0


def _wait_for_step(log_dir: Path, at_least: int, proc: subprocess.Popen, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        for path in log_dir.glob("debug_rank0_*.log"):
            steps = re.findall(r"Training step (\d+),", path.read_text(errors="replace"))
            if steps and int(steps[-1]) >= at_least:
                return
        time.sleep(0.05)
    raise AssertionError(f"training never reached step {at_least}")


def test_sigterm_saves_on_every_rank_and_resume_continues(make_shards, tmp_path: Path) -> None:
    """SIGTERM to the launcher (as `docker stop` sends it) -> every rank saves the same step
    checkpoint and exits 0; `--resume_from_checkpoint=last` continues that step, LR and epoch.

    A long warmup makes the LR a function of the step alone, so the resumed run may stop
    earlier than the first one would have and still must follow the same schedule."""
    train = make_shards([40, 40, 30, 20], name="train")  # 8 batches of 8 per rank per epoch
    val = make_shards([24], name="val")
    out = tmp_path / "run"
    args = [f"--output_dir={out}", f"--train_shards={train}", f"--val_shards={val}",
            "--batch_size=8", "--num_workers=1", "--max_epochs=-1", "--learning_rate=1e-3",
            "--lr_scale=linear", "--warmup_steps=1000", "--lr_scheduler=constant",
            "--checkpointing_period=1000", "--debug=true"]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k not in ("AE_RUN_TS", "MASTER_PORT")}
    env["AE_CACHE_DIR"] = str(tmp_path / "cache")
    proc = subprocess.Popen(
        [sys.executable, "-m", "ae.cli.launch", *args, "--max_steps=2000"],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    try:
        _wait_for_step(out / "logs", 10, proc, timeout=180)  # into epoch 1
        proc.send_signal(signal.SIGTERM)
        output = proc.communicate(timeout=120)[0]
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 143, output  # documented: 128 + SIGTERM
    m = re.search(r"Preempted \(SIGTERM\) at step (\d+); checkpoint saved at ", output)
    assert m, output
    n = int(m.group(1))
    lrs_before = set()
    for rank in (0, 1):
        text = "".join(p.read_text() for p in (out / "logs").glob(f"debug_rank{rank}_*.log"))
        pre = re.search(rf"PREEMPTED by SIGTERM at step {n}: checkpoint .* \(LR (\S+)\)", text)
        assert pre, text[-3000:]
        lrs_before.add(pre.group(1))
        assert f"CHECKPOINT SAVE END ========== step {n} (preemption)" in text
        assert "Rank exiting with code 0: preempted" in text
    (lr_before,) = lrs_before  # both ranks hold the same LR
    last = torch.load(out / "checkpoints" / "last.ckpt", weights_only=False)
    assert last["global_step"] == n
    # The epoch's loss sum so far, both ranks' (reduced at the save), for the resumed epoch's
    # train/loss_epoch: every batch of it (all 8 when the signal came at its last step)
    carried = last["ae_epoch_loss"]
    assert carried["count"] == 2 * (n % 8 or 8) and carried["total"] > 0, carried
    stopped = diagnose(find_run(out / "logs"))  # saved and exited 0, but not done training
    assert stopped["status"] == "stopped" and stopped["stopped_by"]["step"] == n, stopped

    res = run_launcher(
        [*args[1:], f"--max_steps={n + 6}", "--resume_from_checkpoint=last"], out, env=None
    )
    assert res.returncode == 0, res.output
    logs = sorted(res.logs.glob("train_*.log"))
    assert len(logs) == 2
    main = logs[-1].read_text()
    epoch, batch = divmod(n, 8)
    resumed = re.search(rf"Resumed from .*last\.ckpt at step {n} \(epoch \d+, LR (\S+)\)", main)
    assert resumed and resumed.group(1) == lr_before, main
    assert f"Training finished at step {n + 6}" in main
    rank0 = sorted(res.logs.glob("debug_rank0_*.log"))[-1].read_text()
    if batch:  # mid-epoch: the rest of that epoch
        assert f"Resuming the train data at epoch {epoch}, batch {batch} of 8" in rank0
        assert re.search(
            rf"EPOCH {epoch} TRAINING START ========== \(resumed at batch {batch}\)", rank0
        )
    else:  # the signal came at an epoch's last step: the next epoch starts whole
        assert re.search(rf"EPOCH {epoch} TRAINING START ==========\s*$", rank0, re.M), rank0
        assert "resumed at batch" not in rank0
    # The heartbeat (ae-diagnose's epoch column) names the epoch the run ended in, a resumed
    # epoch's too (step s is batch (s - 1) % 8 of epoch (s - 1) // 8)
    beat = json.loads(sorted(res.logs.glob("heartbeat_rank0_*.json"))[-1].read_text())
    assert beat["epoch"] == (n + 5) // 8, beat
    assert re.search(
        rf"Processing \d/4 files from train_shards \(\d+ samples planned, epoch {epoch}\)", rank0
    )
    lrs = _lrs(rank0)
    assert min(lrs) == n + 1  # the first step after the checkpoint's
    for step, lr in lrs.items():  # constant warmup: LR after k steps is 2e-3 * (k + 1) / 1000
        assert lr == pytest.approx(2e-3 * (step + 1) / 1000, rel=2e-3)
    assert yaml.safe_load((out / "config.yaml").read_text())["resume_from_checkpoint"] == "last"
