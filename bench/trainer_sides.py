"""The three sides of `bench.trainer_overhead`, each as one measured process runs it: a hand-written
loop, a bare Lightning Trainer, and ae's trainer as a rank builds it; and the clock they share,
which counts only the process's own turns (bench/lockstep.py)."""

from __future__ import annotations

import cProfile
import importlib
import os
import pstats
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader

from bench.common import synthetic_shards
from bench.lockstep import Turns
from bench.trainer_variants import change_trainer

DIM, BATCH, WARMUP = 64, 256, 20
# Optimizer steps a side runs in its turn (~50 ms here): a round of turns, even of every variant
# (15 sides), is shorter than the drift of a shared machine's speed (seconds).
SLICE = 10
SIDES = ("manual", "lightning", "ae")
DATA = Path("/tmp/ae-bench-data")
COUNT_CALLS = "AE_BENCH_COUNT_CALLS"  # set: the worker counts Python calls, not time
# The modules the sides import inside their functions, and those their runs import on first use
# (the TensorBoard writer, the shard reader, the loss curve's plot): `preload`
PRELOAD = (
    *("lightning.pytorch.loggers", "lightning.pytorch.strategies", "logging_cfg", "ae.config"),
    *("ae.data.datamodule", "ae.data.decoding.decode", "ae.forensics.flight_recorder"),
    *("ae.forensics.step_times", "ae.forensics.watchdog", "ae.stragglers", "ae.training.lr"),
    *("ae.training.model", "ae.training.trainer", "torch.utils.tensorboard", "webdataset"),
    "matplotlib.backends.backend_agg",
)


def preload() -> None:
    """Import what the sides import when they run: for a process that forks them (`--quick`),
    which then pays the seconds of importing Lightning and ae once instead of once a process."""
    for name in PRELOAD:
        importlib.import_module(name)


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
    training thread's that cost without gloo's, the watchdog's and the loggers' threads. Only
    this side's turns count (`tick` waits for the next one every SLICE steps). With COUNT_CALLS
    set (the profiler slows every call), the Python function calls of the window too: a count
    that no load disturbs, and most of a tiny step's framework cost."""

    def __init__(self, steps: int, side: str) -> None:
        self.steps = steps
        self.turns = Turns(side)
        self.wall = self.cpu = self.thread_cpu = 0.0
        self.profile = cProfile.Profile() if os.environ.get(COUNT_CALLS) else None

    def start(self) -> None:
        """At the window's start: after WARMUP steps, in this side's first turn."""
        self.turns.wait()
        self._resume()

    def tick(self, done: int) -> None:
        """After optimizer step `done`: within the window, every SLICE steps, the turn passes on."""
        if WARMUP < done < self.steps - 1 and (done - WARMUP) % SLICE == 0:
            self._pause()
            self.turns.wait()
            self._resume()

    def stop(self) -> None:
        """After optimizer step steps - 1; waits until every side is done."""
        self._pause()
        self.turns.wait(last=True)

    def _resume(self) -> None:
        self.wall -= time.perf_counter()
        self.cpu -= time.process_time()
        self.thread_cpu -= time.thread_time()
        if self.profile is not None:
            self.profile.enable()

    def _pause(self) -> None:
        if self.profile is not None:
            self.profile.disable()
        self.wall += time.perf_counter()
        self.cpu += time.process_time()
        self.thread_cpu += time.thread_time()

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
    clock = Clock(steps, "manual")
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
        clock.tick(i)
    return clock.rates()


def _timer(steps: int, side: str):
    """A callback that clocks optimizer steps WARMUP + 1 .. steps - 1, appended after every other
    callback (so the window holds their hooks too)."""
    import lightning as L

    class Timer(L.Callback):
        def __init__(self) -> None:
            self.clock = Clock(steps, side)

        def on_train_batch_start(self, trainer, *args) -> None:
            if trainer.global_step == WARMUP:
                self.clock.start()

        def on_train_batch_end(self, trainer, *args) -> None:
            if trainer.global_step == steps - 1:
                self.clock.stop()
            self.clock.tick(trainer.global_step)

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

    timer = _timer(steps, "lightning")
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
    timer = _timer(steps, "ae" if variant is None else f"ae:{variant}")
    trainer.callbacks.append(timer)
    try:
        trainer.fit(_model(), datamodule=datamodule)
    finally:
        stop_watchdog()
    return timer.clock.rates()
