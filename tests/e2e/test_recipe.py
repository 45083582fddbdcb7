"""End-to-end training recipe on 2 gloo ranks: LR scaling, validation cadence, checkpoints,
sampling with an injected OOM. SIGTERM preemption on every rank and its resume: the stopped run of
tests/e2e/test_hot_loop.py (one launch for both)."""

from __future__ import annotations

import csv
import re
from pathlib import Path

import pytest
import torch
from PIL import Image

from ae.config import parse_config
from ae.training.lr import lr_factor

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
