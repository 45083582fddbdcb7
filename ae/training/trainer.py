"""Builds the Lightning Trainer for a run: strategy, precision, stop conditions, callbacks."""

from __future__ import annotations

import os
import sys
from datetime import timedelta

import lightning as L
import torch
from lightning.fabric.plugins.environments import TorchElasticEnvironment
from lightning.pytorch.callbacks import RichProgressBar
from lightning.pytorch.strategies import DDPStrategy

from ae.config import Config, ConfigError, RunConfig
from ae.data.datamodule import EpochSync
from ae.forensics.loop_tracer import DebugCallback
from ae.training.checkpointing import AtomicCheckpointIO, Checkpointing
from ae.training.clock import ClockOffset
from ae.training.ema import EMA
from ae.training.metrics import build_loggers, metric_callbacks
from ae.training.preemption import Preemption
from ae.training.sampling import Sampling
from ae.training.val_schedule import ValidationSchedule
from logging_cfg import RankContext


def resolve_accelerator(run: RunConfig) -> str:
    if run.accelerator == "auto":
        return "gpu" if torch.cuda.is_available() else "cpu"
    return run.accelerator


def check_precision(run: RunConfig, accelerator: str) -> None:
    if (
        accelerator == "gpu"
        and run.precision == "bf16-mixed"
        and not torch.cuda.is_bf16_supported()
    ):
        raise ConfigError(
            ["precision: bf16-mixed needs a GPU with bfloat16 (Ampere or newer); use 16-mixed"]
        )


def build_callbacks(cfg: Config, ctx: RankContext) -> list[L.Callback]:
    """Order matters on a step that is due for several things: the EMA update, checkpoint, then
    the preemption check (which saves unless that checkpoint already covers the step), then
    sampling."""
    checkpointing = Checkpointing(cfg.checkpoints, cfg.run.dir, settings=cfg.to_dict())
    obs = cfg.obs
    callbacks: list[L.Callback] = [
        ClockOffset(),
        EpochSync(),
        DebugCallback(
            debug=obs.debug,
            every_train=obs.log_every_n_train_batches,
            every_val=obs.log_every_n_val_batches,
        ),
        ValidationSchedule(cfg.run.val_interval),
        checkpointing,
        Preemption(checkpointing),
        Sampling(obs, cfg.run.dir),
        *metric_callbacks(cfg.run.dir),
    ]
    if cfg.model.ema_decay > 0:
        # First: after an optimizer step the average is updated before a checkpoint saves it
        # and before a grid shows it.
        callbacks.insert(0, EMA(cfg.model.ema_decay))
    if sys.stderr.isatty() and ctx.rank == 0:
        callbacks.append(RichProgressBar())
    return callbacks


def build_trainer(cfg: Config, ctx: RankContext, run_ts: str) -> L.Trainer:
    run, optim = cfg.run, cfg.optim
    accelerator = resolve_accelerator(run)
    check_precision(run, accelerator)
    devices = ctx.world_size // run.num_nodes if ctx.world_size > 1 else 1
    strategy: str | DDPStrategy = "auto"
    if ctx.world_size > 1:
        strategy = DDPStrategy(
            process_group_backend="nccl" if accelerator == "gpu" else "gloo",
            # Ranks waiting in a collective for a dead or stuck peer fail after this, rather
            # than the 30 minutes of Lightning's default.
            timeout=timedelta(seconds=cfg.obs.pg_timeout),
        )
    callbacks = build_callbacks(cfg, ctx)
    plugins: list = [AtomicCheckpointIO()]
    if ctx.world_size > 1 and "RANK" in os.environ:
        # The process is described by RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT (torchrun,
        # or the launcher for a SLURM task): said explicitly, so that Lightning does not take a
        # SLURM task for its own SLURM layout (which rejects `srun -n2` without
        # --ntasks-per-node) when no torchrun is in between.
        plugins.append(TorchElasticEnvironment())
    return L.Trainer(
        accelerator=accelerator,
        devices=devices,
        num_nodes=run.num_nodes,
        strategy=strategy,
        precision=run.precision,
        plugins=plugins,
        max_epochs=run.max_epochs,
        max_steps=run.max_steps,
        accumulate_grad_batches=optim.gradient_accumulation_steps,
        gradient_clip_val=optim.gradient_clip_val or None,
        val_check_interval=1.0,  # epoch end; ValidationSchedule adds every --val_interval steps
        use_distributed_sampler=False,  # the shard plan already splits the data per rank
        num_sanity_val_steps=0,
        logger=build_loggers(run.dir, run_ts),
        callbacks=callbacks,
        enable_checkpointing=False,  # ae.training.checkpointing saves instead of ModelCheckpoint
        enable_progress_bar=any(isinstance(c, RichProgressBar) for c in callbacks),
        enable_model_summary=False,  # train_ae.py logs it to the train log instead
        default_root_dir=run.output_dir,
        log_every_n_steps=10,
    )
