"""Builds the Lightning Trainer for a run: strategy, precision, stop conditions, callbacks."""

from __future__ import annotations

import sys
from datetime import timedelta

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint, RichProgressBar
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.strategies import DDPStrategy

from ae.config import Config
from ae.datamodule import EpochSync
from ae.debug_callback import DebugCallback
from logging_cfg import RankContext


def resolve_accelerator(cfg: Config) -> str:
    if cfg.accelerator == "auto":
        return "gpu" if torch.cuda.is_available() else "cpu"
    return cfg.accelerator


def build_trainer(cfg: Config, ctx: RankContext) -> L.Trainer:
    accelerator = resolve_accelerator(cfg)
    devices = ctx.world_size // cfg.num_nodes if ctx.world_size > 1 else 1
    strategy: str | DDPStrategy = "auto"
    if ctx.world_size > 1:
        strategy = DDPStrategy(
            process_group_backend="nccl" if accelerator == "gpu" else "gloo",
            # Ranks waiting in a collective for a dead or stuck peer fail after this, rather
            # than the 30 minutes of Lightning's default.
            timeout=timedelta(seconds=cfg.pg_timeout),
        )
    callbacks: list[L.Callback] = [
        EpochSync(),
        DebugCallback(
            debug=cfg.debug,
            every_train=cfg.log_every_n_train_batches,
            every_val=cfg.log_every_n_val_batches,
        ),
    ]
    if cfg.checkpointing_period > 0:
        callbacks.append(
            ModelCheckpoint(
                dirpath=cfg.checkpoints_dir,
                every_n_train_steps=cfg.checkpointing_period,
                save_top_k=cfg.checkpoints_total_limit,
                monitor="step",
                mode="max",
                save_last=True,
            )
        )
    interactive = sys.stderr.isatty() and ctx.rank == 0
    if interactive:
        callbacks.append(RichProgressBar())
    return L.Trainer(
        accelerator=accelerator,
        devices=devices,
        num_nodes=cfg.num_nodes,
        strategy=strategy,
        precision=cfg.precision,
        max_epochs=cfg.max_epochs,
        max_steps=cfg.max_steps,
        accumulate_grad_batches=cfg.gradient_accumulation_steps,
        gradient_clip_val=cfg.gradient_clip_val or None,
        use_distributed_sampler=False,  # the shard plan already splits the data per rank
        num_sanity_val_steps=0,
        logger=CSVLogger(cfg.output_dir, name="metrics", version=""),
        callbacks=callbacks,
        enable_progress_bar=interactive,
        enable_model_summary=False,  # train_ae.py logs it to the train log instead
        default_root_dir=cfg.output_dir,
        log_every_n_steps=10,
    )
