"""Builds the Lightning Trainer for a run: strategy, precision, stop conditions, callbacks."""

from __future__ import annotations

import sys
from datetime import timedelta

import lightning as L
import torch
from lightning.pytorch.callbacks import RichProgressBar
from lightning.pytorch.strategies import DDPStrategy

from ae.checkpointing import AtomicCheckpointIO, Checkpointing
from ae.config import Config, ConfigError
from ae.datamodule import EpochSync
from ae.debug_callback import DebugCallback
from ae.metrics import build_loggers, metric_callbacks
from ae.preemption import Preemption
from ae.sampling import Sampling
from ae.val_schedule import ValidationSchedule
from logging_cfg import RankContext


def resolve_accelerator(cfg: Config) -> str:
    if cfg.accelerator == "auto":
        return "gpu" if torch.cuda.is_available() else "cpu"
    return cfg.accelerator


def check_precision(cfg: Config, accelerator: str) -> None:
    if (
        accelerator == "gpu"
        and cfg.precision == "bf16-mixed"
        and not torch.cuda.is_bf16_supported()
    ):
        raise ConfigError(
            ["precision: bf16-mixed needs a GPU with bfloat16 (Ampere or newer); use 16-mixed"]
        )


def build_callbacks(cfg: Config, ctx: RankContext) -> list[L.Callback]:
    """Order matters on a step that is due for several things: checkpoint, then the preemption
    check (which saves unless that checkpoint already covers the step), then sampling."""
    checkpointing = Checkpointing(cfg)
    callbacks: list[L.Callback] = [
        EpochSync(),
        DebugCallback(
            debug=cfg.debug,
            every_train=cfg.log_every_n_train_batches,
            every_val=cfg.log_every_n_val_batches,
        ),
        ValidationSchedule(cfg.val_interval),
        checkpointing,
        Preemption(checkpointing),
        Sampling(cfg),
        *metric_callbacks(),
    ]
    if sys.stderr.isatty() and ctx.rank == 0:
        callbacks.append(RichProgressBar())
    return callbacks


def build_trainer(cfg: Config, ctx: RankContext, run_ts: str) -> L.Trainer:
    accelerator = resolve_accelerator(cfg)
    check_precision(cfg, accelerator)
    devices = ctx.world_size // cfg.num_nodes if ctx.world_size > 1 else 1
    strategy: str | DDPStrategy = "auto"
    if ctx.world_size > 1:
        strategy = DDPStrategy(
            process_group_backend="nccl" if accelerator == "gpu" else "gloo",
            # Ranks waiting in a collective for a dead or stuck peer fail after this, rather
            # than the 30 minutes of Lightning's default.
            timeout=timedelta(seconds=cfg.pg_timeout),
        )
    callbacks = build_callbacks(cfg, ctx)
    return L.Trainer(
        accelerator=accelerator,
        devices=devices,
        num_nodes=cfg.num_nodes,
        strategy=strategy,
        precision=cfg.precision,
        plugins=[AtomicCheckpointIO()],
        max_epochs=cfg.max_epochs,
        max_steps=cfg.max_steps,
        accumulate_grad_batches=cfg.gradient_accumulation_steps,
        gradient_clip_val=cfg.gradient_clip_val or None,
        val_check_interval=1.0,  # epoch end; ValidationSchedule adds every --val_interval steps
        use_distributed_sampler=False,  # the shard plan already splits the data per rank
        num_sanity_val_steps=0,
        logger=build_loggers(cfg.output_dir, run_ts),
        callbacks=callbacks,
        enable_checkpointing=False,  # ae.checkpointing saves instead of ModelCheckpoint
        enable_progress_bar=any(isinstance(c, RichProgressBar) for c in callbacks),
        enable_model_summary=False,  # train_ae.py logs it to the train log instead
        default_root_dir=cfg.output_dir,
        log_every_n_steps=10,
    )
