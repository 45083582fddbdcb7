"""Trainer overhead: optimizer steps/s of `ae` (Lightning + our callbacks + logging), of a bare
Lightning Trainer (no ae callbacks; the two loggers ae writes by default) and of a hand-written
PyTorch loop, same model, same tensors, 1 process and 2-process DDP (gloo on CPU), all measured
in one run.

The three sides train the `AutoEncoder` on the same pre-made batches (no data pipeline: that has
its own bench), with the same AdamW + warmup/cosine schedule and gradient clipping. The hand
loop is what a trainer would cost if it were free; bare Lightning / hand loop is what Lightning
itself costs, ae / bare Lightning what ae adds on top (callbacks, forensics, its own logging).

The ae side gets what a rank gets (`ae/rank/train.py`): logging configured, `build_trainer` with
every callback, and a `ShardDataModule` over a small shard set (its validation split is what
sampling reads); only its train loader is replaced by the pre-made batches. Each side's rate is
timed inside the loop, from the start of step 21 to the end of the last step but one, so process
start, setup, the final checkpoint of ae's last step, the epoch-end validation and teardown are
left out alike: what is left is the cost of a step.

The ae side is a rank as `ae/rank/train.py` starts it, the watchdog thread and the Flight
Recorder included. `--variants` adds sides that are ae with one piece taken out (or, for
`old_stop_check` and `with_ema`, put in): each is timed in the same interleaved rounds, and its
cost per step is 1 / rate(ae) - 1 / rate(ae without it) (bench/README.md has the table).

The figures are medians over `--repeats` rounds; a round runs every side once, in turn, so a busy
moment of a shared machine hits all of them alike. Then each side runs once more to count its
Python function calls a step in the same window (`calls_per_step`): a figure no load moves
(`--quick`, a smoke run, counts them in its one round instead).

Usage: python -m bench.trainer_overhead [--steps 600] [--repeats 5] [--worlds 1,2]
           [--variants no_vote,old_stop_check,...|all] [--quick]
    (writes bench/results/trainer_overhead.json; --quick: trainer_overhead_quick.json)
The non-finite check's cost (issue 36): `--variants no_nonfinite_guard`.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader

from bench.common import synthetic_shards, write_record
from bench.trainer_variants import VARIANTS, change_trainer

DIM, BATCH, WARMUP = 64, 256, 20
SIDES = ("manual", "lightning", "ae")
DATA = Path("/tmp/ae-bench-data")
COUNT_CALLS = "AE_BENCH_COUNT_CALLS"  # set: the worker counts Python calls, not time


def _batches(steps: int, rank: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(rank)
    return [torch.rand(BATCH, DIM, generator=g) for _ in range(steps)]


def _model():
    from ae.config import ModelConfig
    from ae.data.decoding.decode import InputSpec
    from ae.training.model import AutoEncoder

    torch.manual_seed(0)
    return AutoEncoder(InputSpec("vector", (DIM,)), ModelConfig(hidden_dim=256, latent_dim=16))


class Clock:
    """Optimizer steps WARMUP + 1 .. steps - 1 in wall time, in CPU time of this process (all
    its threads) and of the training thread alone: the wall rate is what a user sees, the CPU
    rate the per-step cost, which other processes on a shared machine disturb less, the
    training thread's that cost without gloo's, the watchdog's and the loggers' threads. With
    COUNT_CALLS set (a run of its own: the profiler slows every call), the Python function calls
    of the window instead: a count that no load disturbs, and most of a tiny step's framework
    cost."""

    def __init__(self, steps: int) -> None:
        self.steps = steps
        self.wall = self.cpu = self.thread_cpu = 0.0
        self.profile = cProfile.Profile() if os.environ.get(COUNT_CALLS) else None

    def start(self) -> None:
        self.wall, self.cpu = time.perf_counter(), time.process_time()
        self.thread_cpu = time.thread_time()
        if self.profile is not None:
            self.profile.enable()

    def stop(self) -> None:
        if self.profile is not None:
            self.profile.disable()
        self.wall, self.cpu = time.perf_counter() - self.wall, time.process_time() - self.cpu
        self.thread_cpu = time.thread_time() - self.thread_cpu

    def rates(self) -> dict[str, float]:
        n = timed_steps(self.steps)
        rates = {"wall": n / self.wall, "cpu": n / self.cpu, "thread_cpu": n / self.thread_cpu}
        if self.profile is not None:  # the rates are the profiled run's (--quick only keeps them)
            stats = pstats.Stats(self.profile).stats  # type: ignore[attr-defined]
            rates["calls"] = sum(stat[1] for stat in stats.values()) / n
        return rates


def timed_steps(steps: int) -> int:
    return steps - 1 - WARMUP


def run_manual(steps: int, world: int) -> dict[str, float]:
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
    clock = Clock(steps)
    for i, x in enumerate(batches, start=1):  # i: the optimizer step this batch makes
        if i == WARMUP + 1:
            clock.start()
        loss = torch.nn.functional.mse_loss(net(x), x)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        if i == steps - 1:
            clock.stop()
    return clock.rates()


def _timer(steps: int):
    """A callback that clocks optimizer steps WARMUP + 1 .. steps - 1, appended after every other
    callback (so the window holds their hooks too)."""
    import lightning as L

    class Timer(L.Callback):
        def __init__(self) -> None:
            self.clock = Clock(steps)

        def on_train_batch_start(self, trainer, *args) -> None:
            if trainer.global_step == WARMUP:
                self.clock.start()

        def on_train_batch_end(self, trainer, *args) -> None:
            if trainer.global_step == steps - 1:
                self.clock.stop()

    return Timer()


def run_lightning(steps: int, world: int, logs: Path) -> dict[str, float]:
    """A bare Lightning Trainer: its defaults, no callback but the timer, the same clipping and
    schedule (the model's own `configure_optimizers`), and the loggers ae writes by default
    (`--logger=csv,tensorboard`) at ae's cadence: what a Lightning user gets with logging (its
    own default, `logger=True`, is a TensorBoard logger), so that the ratio compares the
    trainers' per-step work, not whether the metrics are written."""
    import lightning as L
    from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger
    from lightning.pytorch.strategies import DDPStrategy

    timer = _timer(steps)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=world,
        strategy=DDPStrategy(process_group_backend="gloo") if world > 1 else "auto",
        max_steps=steps,
        max_epochs=1,
        gradient_clip_val=1.0,
        use_distributed_sampler=False,
        num_sanity_val_steps=0,
        logger=[CSVLogger(logs, name="metrics"), TensorBoardLogger(logs, name="tensorboard")],
        callbacks=[timer],
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        log_every_n_steps=10,  # ae's cadence: the model logs its step loss as often on both
    )
    rank = int(os.environ.get("RANK", 0))
    trainer.fit(_model(), train_dataloaders=DataLoader(_batches(steps, rank), batch_size=None))
    return timer.clock.rates()


def run_ae(steps: int, world: int, logs: Path, variant: str | None = None) -> dict[str, float]:
    """Our trainer as a rank builds it (ae/rank/train.py): logging configured, the Flight
    Recorder and the watchdog on, every callback, a shard data module whose train loader gives
    the pre-made batches; `variant`: one piece out (or in), a key of VARIANTS."""
    import logging_cfg
    from ae.config import parse_config
    from ae.data.datamodule import ShardDataModule
    from ae.forensics import flight_recorder
    from ae.forensics.step_times import step_times
    from ae.forensics.watchdog import start_watchdog, stop_watchdog
    from ae.stragglers import recent_window_s
    from ae.training.trainer import build_trainer

    # 2 x 1024 vectors: one validation pass of a few batches per rank, after the timed window.
    urls = synthetic_shards(DATA, "npy", 2, 1024, dim=DIM)
    cfg = parse_config(
        [f"--output_dir={logs}", f"--max_steps={steps}", "--max_epochs=1", "--warmup_steps=50",
         "--checkpointing_period=0", "--accelerator=cpu", f"--devices={world}",
         f"--batch_size={BATCH}", "--num_workers=0", f"--count_cache={logs / 'counts'}",
         *(["--ema_decay=0.999"] if variant == "with_ema" else [])]
    )  # fmt: skip
    ctx = logging_cfg.RankContext.from_env()
    paths = logging_cfg.configure(cfg.run.dir.logs, "bench", ctx, debug=cfg.obs.debug)
    obs = cfg.obs
    if variant != "no_flight_recorder":
        flight_recorder.enable(paths.logs_dir, ctx.rank, "bench")
    if variant != "no_watchdog":
        start_watchdog(
            obs.stall_timeout, "cpu", ctx, paths, "bench", straggler_factor=obs.straggler_factor,
            straggler_window=obs.straggler_window, hang_timeout=obs.hang_timeout,
        )  # fmt: skip

    class PremadeBatches(ShardDataModule):
        def train_dataloader(self) -> DataLoader:
            return DataLoader(_batches(steps, ctx.rank), batch_size=None)

    datamodule = PremadeBatches(cfg.data, urls, urls, seed=cfg.run.seed)
    step_times.configure(recent_window_s(obs.straggler_window), datamodule.train_worker_rates)
    trainer = build_trainer(cfg, ctx, "bench", {})
    if variant is not None:
        change_trainer(variant, trainer)
    timer = _timer(steps)
    trainer.callbacks.append(timer)
    try:
        trainer.fit(_model(), datamodule=datamodule)
    finally:
        stop_watchdog()
    return timer.clock.rates()


def _worker(args: argparse.Namespace) -> None:
    world = int(os.environ.get("WORLD_SIZE", 1))
    if args.side == "manual":
        if world > 1:
            dist.init_process_group("gloo")
        rate = run_manual(args.steps, world)
    elif args.side == "lightning":
        rate = run_lightning(args.steps, world, Path(args.out).parent / "run")
    else:
        variant = args.side.removeprefix("ae:") if args.side != "ae" else None
        rate = run_ae(args.steps, world, Path(args.out).parent / "run", variant)
    if int(os.environ.get("RANK", 0)) == 0:
        Path(args.out).write_text(json.dumps(rate))
    if dist.is_initialized():
        # Both ranks done with every collective before either tears its group down (a rank that
        # destroyed gloo under a peer still in it once aborted the peer: SIGABRT).
        dist.barrier()
        dist.destroy_process_group()


def _measure(side: str, world: int, steps: int, count_calls: bool = False) -> dict[str, float]:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        worker = ["-m", "bench.trainer_overhead", "--worker", f"--side={side}", f"--steps={steps}",
                  f"--out={out}"]  # fmt: skip
        # One process needs no torchrun (its agent alone is a second interpreter with torch).
        launch = ["-m", "torch.distributed.run", f"--nproc_per_node={world}", "--standalone"]
        cmd = [sys.executable, *(launch if world > 1 else []), *worker]
        # One thread per process: the math of a 256 x 64 batch gains nothing from a second one on
        # a shared machine, and the CPU time then counts the step's work, not idle spinning.
        env = {**os.environ, "OMP_NUM_THREADS": "1", **({COUNT_CALLS: "1"} if count_calls else {})}
        for attempt in (1, 2):  # one more try: a crash on a loaded machine costs the whole run
            done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
            if done.returncode == 0:
                return json.loads(out.read_text())
            print(f"{side} side, {world} process(es) failed (try {attempt} of 2):\n"
                  f"{done.stderr[-4000:]}", flush=True)  # fmt: skip
        sys.exit(f"{side} side, {world} process(es) failed twice")


def _medians(rates: dict[str, list[dict[str, float]]], clock: str) -> dict[str, float]:
    return {side: statistics.median(r[clock] for r in runs) for side, runs in rates.items()}


def _row(world: int, rates: dict[str, list[dict[str, float]]]) -> dict:
    """The median rate of each side, wall and CPU, the three ratios of each, and per variant
    its rate against ae's and its cost per step (us; negative: the variant is the slower)."""
    row: dict = {"processes": world, "all": rates}
    for clock in ("wall", "cpu", "thread_cpu"):
        med = _medians(rates, clock)
        row[clock] = {
            **med,
            "ae_vs_manual": med["ae"] / med["manual"],
            "lightning_vs_manual": med["lightning"] / med["manual"],
            "ae_vs_lightning": med["ae"] / med["lightning"],
            "variants": {
                side.removeprefix("ae:"): {
                    "vs_ae": rate / med["ae"],
                    "cost_us_per_step": 1e6 * (1 / med["ae"] - 1 / rate),
                }
                for side, rate in med.items()
                if side.startswith("ae:")
            },
        }
    return row


def _report(world: int, row: dict) -> None:
    for clock, unit in (
        ("wall", "steps/s"),
        ("cpu", "steps per CPU s"),
        ("thread_cpu", "steps per CPU s of the training thread"),
    ):
        r = row[clock]
        print(
            f"{world} process(es), {unit} (median): hand loop {r['manual']:.1f}, bare Lightning"
            f" {r['lightning']:.1f}, ae {r['ae']:.1f} -> ae / hand loop {r['ae_vs_manual']:.3f}x,"
            f" bare Lightning / hand loop {r['lightning_vs_manual']:.3f}x, ae / bare Lightning"
            f" {r['ae_vs_lightning']:.3f}x",
            flush=True,
        )
        for name, v in r["variants"].items():
            print(f"    ae {name}: {v['vs_ae']:.3f}x ae, {v['cost_us_per_step']:+.0f} us a step")
    calls = row["calls_per_step"]
    more = {side: n - calls["ae"] for side, n in calls.items() if side.startswith("ae:")}
    extra = calls["ae"] - calls["lightning"]
    print(
        f"{world} process(es), Python calls a step (rank 0): hand loop {calls['manual']:.0f}, bare"
        f" Lightning {calls['lightning']:.0f}, ae {calls['ae']:.0f} (+{extra:.0f})"
        + "".join(f"; ae {side[3:]} {n:+.0f}" for side, n in more.items()),
        flush=True,
    )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--repeats", type=int, default=5, help="interleaved rounds; medians kept")
    ap.add_argument("--worlds", default="1,2", help="process counts, comma-separated")
    ap.add_argument("--variants", default="", help=f"'all' or some of: {', '.join(VARIANTS)}")
    ap.add_argument(
        "--quick", action="store_true", help="60 steps, one round, calls counted in it: a smoke run"
    )
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--side")
    ap.add_argument("--out")
    args = ap.parse_args()
    if args.worker:
        _worker(args)
        return
    steps, repeats = (60, 1) if args.quick else (args.steps, args.repeats)
    variants = (
        list(VARIANTS) if args.variants == "all" else [v for v in args.variants.split(",") if v]
    )
    if unknown := set(variants) - set(VARIANTS):
        sys.exit(f"unknown variants {sorted(unknown)}; known: {', '.join(VARIANTS)}")
    sides = [*SIDES, *(f"ae:{v}" for v in variants)]
    rows = []
    for world in map(int, args.worlds.split(",")):
        rates: dict[str, list[dict[str, float]]] = {side: [] for side in sides}
        for _ in range(repeats):
            for side in sides:
                rates[side].append(_measure(side, world, steps, count_calls=args.quick))
        row = _row(world, rates)
        # Python calls a step, rank 0's, counted in a run of their own per side (the profiler
        # slows every call). --quick, a smoke run of every path whose figures mean nothing,
        # counts them in its one timed round: half the processes (each costs ~5 s of imports).
        row["calls_per_step"] = {
            side: (rates[side][0] if args.quick else _measure(side, world, steps, True))["calls"]
            for side in sides
        }
        rows.append(row)
        _report(world, row)
    load = os.getloadavg()
    record = {"steps": steps, "timed_steps": timed_steps(steps), "repeats": repeats,
              "variants": {v: VARIANTS[v] for v in variants}, "load_at_end": load[:2],
              "rows": rows}  # fmt: skip
    print(f"load average at the end: {load[0]:.1f} (1 min), {load[1]:.1f} (5 min)")
    print(f"wrote {write_record('trainer_overhead', record, quick=args.quick)}")


if __name__ == "__main__":
    main()
