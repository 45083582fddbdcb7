"""Trainer overhead: optimizer steps/s of `ae` (Lightning + our callbacks + logging) versus a
hand-written PyTorch loop, same model, same tensors, 1 process and 2-process DDP (gloo on CPU).

Both sides train the `AutoEncoder` on the same pre-made batches (no data pipeline: that has its
own bench), with the same AdamW + warmup/cosine schedule and gradient clipping. The manual loop
is what the trainer would cost if it were free; the ratio is what Lightning, the callbacks and
the logging add.

Usage: python -m bench.trainer_overhead [--steps 300]   (writes bench/results/trainer_overhead.json)
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader

from bench.common import write_record

DIM, BATCH, WARMUP = 64, 256, 20


def _batches(steps: int, rank: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(rank)
    return [torch.rand(BATCH, DIM, generator=g) for _ in range(steps)]


def _model():
    from ae.config import ModelConfig
    from ae.data.decode import InputSpec
    from ae.training.model import AutoEncoder

    torch.manual_seed(0)
    return AutoEncoder(InputSpec("vector", (DIM,)), ModelConfig(hidden_dim=256, latent_dim=16))


def run_manual(steps: int, world: int) -> float:
    """The baseline: forward, backward, clip, step, schedule; DDP when world > 1."""
    from ae.training.lr import lr_factor

    model = _model()
    net: torch.nn.Module = model
    if world > 1:
        net = torch.nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=1e-4)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: lr_factor(s, warmup_steps=50, total_steps=steps, kind="cosine")
    )
    batches = _batches(steps, dist.get_rank() if world > 1 else 0)
    t0 = 0.0
    for i, x in enumerate(batches):
        if i == WARMUP:
            t0 = time.perf_counter()
        loss = torch.nn.functional.mse_loss(net(x), x)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
    return (steps - WARMUP) / (time.perf_counter() - t0)


def run_ae(steps: int, world: int, logs: Path) -> float:
    """Our trainer as a rank builds it (ae/rank/train.py): logging configured, every callback on."""
    import lightning as L

    import logging_cfg
    from ae.config import parse_config
    from ae.training.trainer import build_trainer

    cfg = parse_config(
        [f"--output_dir={logs}", f"--max_steps={steps}", "--max_epochs=1", "--warmup_steps=50",
         "--checkpointing_period=0", "--accelerator=cpu", f"--devices={world}"]
    )  # fmt: skip
    ctx = logging_cfg.RankContext.from_env()
    logging_cfg.configure(cfg.run.dir.logs, "bench", ctx, debug=cfg.obs.debug)

    class Timer(L.Callback):
        t0 = 0.0

        def on_train_batch_start(self, trainer, *args) -> None:
            if trainer.global_step == WARMUP:
                Timer.t0 = time.perf_counter()

    trainer = build_trainer(cfg, ctx, "bench")
    trainer.callbacks.append(Timer())
    loader = DataLoader(_batches(steps, ctx.rank), batch_size=None)
    trainer.fit(_model(), train_dataloaders=loader)
    return (steps - WARMUP) / (time.perf_counter() - Timer.t0)


def _worker(args: argparse.Namespace) -> None:
    world = int(os.environ.get("WORLD_SIZE", 1))
    if args.side == "manual" and world > 1:
        dist.init_process_group("gloo")
    rate = (
        run_manual(args.steps, world)
        if args.side == "manual"
        else run_ae(args.steps, world, Path(args.out).parent / "run")
    )
    if int(os.environ.get("RANK", 0)) == 0:
        Path(args.out).write_text(json.dumps({"steps_per_s": rate}))
    if dist.is_initialized():
        dist.destroy_process_group()


def _measure(side: str, world: int, steps: int) -> float:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={world}",
               "--standalone", "-m", "bench.trainer_overhead", "--worker", f"--side={side}",
               f"--steps={steps}", f"--out={out}"]  # fmt: skip
        env = {**os.environ, "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // world))}
        subprocess.run(cmd, check=True, env=env, capture_output=True, timeout=240)
        return json.loads(out.read_text())["steps_per_s"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--side", choices=["manual", "ae"])
    ap.add_argument("--out")
    args = ap.parse_args()
    if args.worker:
        _worker(args)
        return
    rows = []
    for world in (1, 2):
        # Alternate the sides and keep the best of two, so a busy moment hits both alike.
        rates = {"manual": [], "ae": []}
        for _ in range(2):
            for side in ("manual", "ae"):
                rates[side].append(_measure(side, world, args.steps))
        row = {"processes": world, **{k: max(v) for k, v in rates.items()}}
        row["ratio"] = row["ae"] / row["manual"]
        rows.append(row)
        print(
            f"{world} process(es): ae {row['ae']:.1f} steps/s, manual loop {row['manual']:.1f}"
            f" steps/s -> {row['ratio']:.2f}x (target >= 0.9x)"
        )
    print(f"wrote {write_record('trainer_overhead', {'steps': args.steps, 'rows': rows})}")


if __name__ == "__main__":
    main()
