"""End-to-end: the built-in models and a user class train and resume from their checkpoint (the
conv model in tests/e2e/test_image_recipe.py); ae-encode writes latents on 2 ranks and a second
run trains on them.

Each test reuses its launches: a first run of one epoch, then a resumed run to the second epoch;
no dataloader workers (startup time: the data pipeline has tests of its own). Two ranks where the
model's behaviour under DDP is what is checked (a user LightningModule, a user model's
non-contiguous outputs with EMA weights) and where ae-encode splits the shards across ranks; one
rank (a process less: ~5 s of CPU a launch) where the model and its options are the point (the
resnet, the mlp, a user class by import path), with a batch twice as large so that the steps are
the same as on 2 ranks. Built-in models under DDP: tests/e2e/test_recipe.py (the default),
tests/e2e/test_image_recipe.py (the conv model with a discriminator).
"""

from __future__ import annotations

import csv
import io
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from ae.data.shards.index import read_index
from ae.data.shards.tar_samples import iter_samples
from ae.data.shards.writer import write_shard
from tests.support.resumes import assert_resumed
from tests.support.runs import ROOT, RunResult, run_launcher
from tests.support.shards import vector_samples

pytestmark = pytest.mark.slow

USER_CLASS = "tests.support.my_autoencoder:TinyAutoEncoder"
LIGHTNING_CLASS = "tests.support.my_lightning_autoencoder:LitAutoEncoder"


def metrics_rows(out: Path) -> list[dict[str, str]]:
    rows = []
    for path in sorted((out / "metrics").glob("*/metrics.csv")):
        with open(path, newline="") as f:
            rows += list(csv.DictReader(f))
    return rows


def train_then_resume(launch, args: list[str]) -> tuple[RunResult, RunResult]:
    """One epoch, then a second launch resumed from last.ckpt to the end of epoch 2."""
    first = launch([*args, "--max_epochs=1"])
    assert first.returncode == 0, first.output
    resumed = launch([*args, "--max_epochs=2", "--resume_from_checkpoint=last"])
    assert resumed.returncode == 0, resumed.output
    return first, resumed


# One resnet run covers its options together (a launch is ~14 CPU s, mostly imports: the suite's
# time): downsampling by 4, the L1 loss, the VAE's KL term and EMA weights. The conv model trains
# and resumes in tests/e2e/test_image_recipe.py, the mlp below.
RESNET = ["--model=resnet", "--downsample=4", "--base_channels=8", "--channel_mult=1,2,2",
          "--res_blocks=1", "--loss=l1", "--kl_weight=0.01", "--ema_decay=0.9"]  # fmt: skip


def test_resnet_trains_and_resumes_with_l1_kl_and_ema(launch, make_shards, tmp_path: Path) -> None:
    train = make_shards([16, 16], kind="png", name="train")  # 8x8 gray: 4 steps of 8 an epoch
    val = make_shards([12], kind="png", name="val")
    args = [f"--train_shards={train}", f"--val_shards={val}", "--devices=1", "--batch_size=8",
            "--num_workers=0", "--checkpointing_period=2", *RESNET]  # fmt: skip
    first, resumed = train_then_resume(launch, args)
    out = tmp_path / "run"
    text = first.text("train_*.log")
    assert re.search(r"Model: resnet, [\d,]+ parameters, latent ", text)
    (summary,) = re.findall(r"Epoch 0 done: .*", text)
    assert all(re.search(rf"val/{m}=-?[\d.]+", summary) for m in ("mse", "psnr", "ssim"))
    assert_resumed(resumed, at=4, to=8)
    rows = metrics_rows(out)
    psnr = [float(r["val/psnr"]) for r in rows if r.get("val/psnr")]
    assert len(psnr) == 2 and all(0 < p < 100 for p in psnr)  # one per epoch, both runs
    # the epoch-end grids, without --sample_period
    assert sorted(p.name for p in (out / "samples").glob("*.png")) == [
        "step_00000004.png",
        "step_00000008.png",
    ]
    last = torch.load(out / "checkpoints" / "last.ckpt", weights_only=False)
    assert last["global_step"] == 8
    assert any(r.get("val/kl") for r in rows) and "val/kl=" in text
    assert "current_model_state" in last  # the live weights beside the EMA's
    ema, live = last["state_dict"], last["current_model_state"]
    assert any(not torch.equal(ema[k], live[k]) for k in ema)


def _vector_shards(root: Path, sizes: list[int], name: str) -> str:
    start = 0
    for i, n in enumerate(sizes):
        samples = vector_samples(n, 16, start)
        for s in samples:
            s["cls"] = str(int(s["__key__"]) % 10).encode()
        write_shard(root / f"{name}-{i:06d}.tar", samples)
        start += n
    return str(root / f"{name}-{{000000..{len(sizes) - 1:06d}}}.tar")


def test_mlp_then_encode_on_two_ranks_then_a_user_class_on_the_latents(tmp_path: Path) -> None:
    data = tmp_path / "data"
    train = _vector_shards(data, [20, 20, 12], "train")
    val = _vector_shards(data, [16], "val")
    run = tmp_path / "mlp"

    def launch(args: list[str], out: Path = run) -> RunResult:
        return run_launcher(args, out)

    # 1. mlp: 52 samples, batch 8 x 1 rank -> 6 steps an epoch, two epochs (a built-in
    # model's resume: test_resnet_trains_and_resumes_with_l1_kl_and_ema)
    mlp = [f"--train_shards={train}", f"--val_shards={val}", "--devices=1", "--batch_size=8",
           "--num_workers=0", "--model=mlp", "--hidden_dims=32,16", "--latent_dim=4",
           "--checkpointing_period=3", "--max_epochs=2"]  # fmt: skip
    first = launch(mlp)
    assert first.returncode == 0, first.output
    text = first.text("train_*.log")
    assert re.search(r"Model: mlp, [\d,]+ parameters, latent 4 \(4 numbers, 4x fewer", text)
    assert re.search(r"Epoch 0 done: .*val/cosine=[-\d.]+, .*val/rel_error=[\d.]+", text)
    assert "Training finished at step 12" in text

    # 2. ae-encode on 2 ranks: every input sample once, same keys per shard, float16 latents
    out = tmp_path / "latents"
    ckpt = run / "checkpoints" / "last.ckpt"
    enc = subprocess.run(
        [sys.executable, "-m", "ae.cli.encode", str(ckpt), train, str(out), "--devices=2",
         "--batch_size=5", "--dtype=float16", "--keep_fields=cls"],
        cwd=ROOT, capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert enc.returncode == 0, enc.stdout + enc.stderr
    inputs = sorted(data.glob("train-*.tar"))
    assert sorted(p.name for p in out.glob("*.tar")) == [p.name for p in inputs]
    state = torch.load(ckpt, weights_only=True)  # plain data: no allow-list needed
    from ae.training.encoding import model_from_checkpoint  # torch-heavy: here, not at the top
    from ae.training.position.checkpoint_read import spec_from_record

    spec = spec_from_record(state["hyper_parameters"]["spec"])
    model, latent = model_from_checkpoint(state, spec, "ckpt")
    assert latent == (4,)
    for src in inputs:
        expected = list(iter_samples(str(src)))
        got = list(iter_samples(str(out / src.name)))
        assert [s["__key__"] for s in got] == [s["__key__"] for s in expected]
        assert read_index(str(out / src.name)).samples == len(expected)
        for e, g in zip(expected, got, strict=True):
            assert set(g) - {"__key__", "__url__"} == {"latent.npy", "cls"}
            assert g["cls"] == e["cls"]
            z = np.load(io.BytesIO(g["latent.npy"]))
            assert z.dtype == np.float16 and z.shape == (4,)
            x = torch.from_numpy(np.load(io.BytesIO(e["npy"])))[None]
            want = model.encode(x)[0].detach().numpy()
            np.testing.assert_allclose(z, want, rtol=2e-3, atol=2e-3)
    logs = out / "logs"
    native = "".join(p.read_text() for p in logs.glob("native_rank*.log"))
    assert "ResourceWarning" not in native  # rank 0's console stream, left open at exit
    summary = "".join(p.read_text() for p in logs.glob("train_*.log"))
    assert "Encoding done: 52 of 52 samples written (0 bad samples skipped) to 3 shards" in summary
    assert "(step 12, weights)" in summary  # no EMA in this run: the live weights
    plans = [
        re.search(r"this rank: (\d+) shards, (\d+) samples", p.read_text())
        for p in sorted(logs.glob("debug_rank*.log"))
    ]
    assert sorted((int(m[1]), int(m[2])) for m in plans if m) == [(1, 20), (2, 32)]
    # The same command again (a job that stopped halfway would): the complete outputs skipped
    # (here all of them: no rank starts), not refused as another dataset of the same names
    again = subprocess.run(enc.args, cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert again.returncode == 0, again.stdout + again.stderr
    assert f"Nothing to encode: all 3 output shards are complete in {out} " in again.stderr
    assert len(list(logs.glob("train_*.log"))) == 1

    # 3. a user class, by import path with model_args from the config file, on those latents:
    # 1 rank x batch 8, 6 steps an epoch (a user class under DDP: the strided one below, and
    # tests/e2e/test_collectives.py)
    config = tmp_path / "user.yaml"
    config.write_text(f"model: {USER_CLASS}\nmodel_args:\n  latent: 2\n  width: 8\n")
    data_args = [f"--train_shards={out}", f"--val_shards={out}/train-000002.tar",
                 "--num_workers=0", "--checkpointing_period=3"]  # fmt: skip
    user = [f"--config={config}", "--devices=1", "--batch_size=8", *data_args]
    first, resumed = train_then_resume(lambda a: run_launcher(a, tmp_path / "user"), user)
    text = first.text("train_*.log")
    assert f"Model: {USER_CLASS}, " in text and "latent 2 (2 numbers, 2x fewer" in text
    assert re.search(r"Epoch 0 done: .*val/recon=[\d.]+", text)  # its own loss() terms
    assert_resumed(resumed, at=6, to=12)

    # 4. a LightningModule of the user's, trained as it is (its own steps and optimizer) under
    # DDP: 2 ranks x batch 4, 6 steps an epoch
    lit = [f"--model={LIGHTNING_CLASS}", "--model_args={latent: 3}", "--devices=2",
           "--batch_size=4", *data_args]  # fmt: skip
    first, resumed = train_then_resume(lambda a: run_launcher(a, tmp_path / "lit"), lit)
    text = first.text("train_*.log")
    assert f"Model: {LIGHTNING_CLASS} (LightningModule), 31 parameters, latent 3 " in text
    assert re.search(r"Epoch 0 done: .*val/loss=[\d.]+", text)
    assert_resumed(resumed, at=6, to=12)
    state = torch.load(tmp_path / "lit" / "checkpoints" / "last.ckpt", weights_only=False)
    assert state["hyper_parameters"]["latent"] == 3 and state["global_step"] == 12


STRIDED_CLASS = "tests.support.strided_autoencoder:StridedAutoEncoder"


def test_third_party_output_layouts_train_sample_and_encode(make_shards, tmp_path: Path) -> None:
    """A user model whose decode returns a permuted (non-contiguous) tensor and whose encode a
    channels-last float16 latent (what diffusers' AutoencoderKL hands back) on 2 ranks:
    validation with its metrics, sampling, EMA, checkpoints, then ae-encode on 1 rank (the
    split across ranks: test_mlp_then_encode_on_two_ranks_then_a_user_class_on_the_latents)."""
    train = make_shards([16, 16], kind="png", name="train")  # 8x8 gray, as RGB: 4 steps
    val = make_shards([12], kind="png", name="val")
    out = tmp_path / "run"
    res = run_launcher(
        [f"--model={STRIDED_CLASS}", "--channels=3", f"--train_shards={train}",
         f"--val_shards={val}", "--batch_size=4", "--num_workers=0", "--max_epochs=1",
         "--sample_period=2", "--val_interval=2", "--ema_decay=0.9"],
        out,
    )  # fmt: skip
    assert res.returncode == 0, res.output
    text = res.text("train_*.log")
    assert f"Model: {STRIDED_CLASS}, " in text and "latent 4x4x4 " in text
    (summary,) = re.findall(r"Epoch 0 done: .*", text)
    assert all(re.search(rf"val/{m}=-?[\d.]+", summary) for m in ("mse", "psnr", "ssim"))
    assert re.search(r"Sampling at step 2: reconstruction loss \(mse\) [\d.]+", text)
    assert sorted(p.name for p in (out / "samples").glob("*.png")) == [
        "step_00000002.png",
        "step_00000004.png",
    ]
    latents = tmp_path / "latents"
    enc = subprocess.run(
        [sys.executable, "-m", "ae.cli.encode", str(out / "checkpoints" / "last.ckpt"), train,
         str(latents), "--devices=1", "--batch_size=5"],
        cwd=ROOT, capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert enc.returncode == 0, enc.stdout + enc.stderr
    summary = "".join(p.read_text() for p in (latents / "logs").glob("train_*.log"))
    assert "Encoding done: 32 of 32 samples written (0 bad samples skipped) to 2 shards" in summary
    assert "latent.npy float32 4x4x4 per sample" in summary and "EMA weights" in summary
    (sample, *_) = iter_samples(str(latents / "train-000000.tar"))
    z = np.load(io.BytesIO(sample["latent.npy"]))
    assert z.shape == (4, 4, 4) and z.dtype == np.float32 and np.isfinite(z).all()


def test_user_class_mistakes_are_one_message(tmp_path: Path) -> None:
    # the launcher: module not found, before any process starts
    res = run_launcher(["--model=tests.support.nope:Net"], tmp_path / "a")
    assert res.returncode == 2 and "model: no module 'tests.support.nope'" in res.output
    assert "Traceback" not in res.output and not (tmp_path / "a" / "logs").exists()
    res = run_launcher([f"--model={USER_CLASS}x"], tmp_path / "b")
    assert res.returncode == 2 and "defines no 'TinyAutoEncoderx'" in res.output
    # the rank: the constructor fails, before the trainer and any dataloader worker
    proc = subprocess.run(
        [sys.executable, str(ROOT / "train_ae.py"), f"--output_dir={tmp_path / 'c'}",
         f"--model={USER_CLASS}", "--model_args={latnet: 2}", "--num_workers=0"],
        cwd=ROOT, capture_output=True, text=True, timeout=240,
        env={**os.environ, "AE_CACHE_DIR": str(tmp_path / "cache")},
    )  # fmt: skip
    output = proc.stdout + proc.stderr
    assert proc.returncode == 2, output
    assert re.search(r"model: \S+TinyAutoEncoder\(\*\*model_args\) .* TypeError: ", output)
    assert "Traceback" not in output
    (log,) = (tmp_path / "c" / "logs").glob("debug_rank0_*.log")
    assert "Rank exiting with code 2: ModelError" in log.read_text()
    assert "EPOCH 0 TRAINING START" not in log.read_text()
    # the console's one message; the rank's log keeps the traceback it came from
    assert re.search(r"ModelError came from:\nTraceback .*\nTypeError: ", log.read_text(), re.S)
    # the rank: decode returns a dataclass holding the tensor (diffusers' DecoderOutput)
    proc = subprocess.run(
        [sys.executable, str(ROOT / "train_ae.py"), f"--output_dir={tmp_path / 'd'}",
         "--model=tests.support.strided_autoencoder:ReturnsDecoderOutput", "--num_workers=0"],
        cwd=ROOT, capture_output=True, text=True, timeout=240,
        env={**os.environ, "AE_CACHE_DIR": str(tmp_path / "cache")},
    )  # fmt: skip
    output = proc.stdout + proc.stderr
    assert proc.returncode == 2, output
    assert "model: decode returned DecoderOutput; return its .sample" in output
    assert "Traceback" not in output
    (log,) = (tmp_path / "d" / "logs").glob("debug_rank0_*.log")
    assert "EPOCH 0 TRAINING START" not in log.read_text()
