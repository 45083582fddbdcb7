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
from ae.config.checks import CPU_16_MIXED
from ae.data.bad_data_limit import BadDataBound
from ae.data.epoch_sync import EpochSync
from ae.forensics.loop_tracer import DebugCallback
from ae.training.batch_hooks import route
from ae.training.checkpointing import AtomicCheckpointIO, Checkpointing
from ae.training.clock import ClockOffset
from ae.training.ema import EMA
from ae.training.loss_curve import LossCurve
from ae.training.metrics import LOG_EVERY_N_STEPS, build_loggers, metric_callbacks
from ae.training.nonfinite import NonFiniteGuard
from ae.training.position.sync import PositionSync
from ae.training.preemption import Preemption
from ae.training.rank_series import RankSeries
from ae.training.sampling import Sampling
from ae.training.step_boundary import TRAINER_VALIDATION_ARGS, StepBoundary
from logging_cfg import RankContext


def resolve_accelerator(run: RunConfig) -> str:
    if run.accelerator == "auto":
        return "gpu" if torch.cuda.is_available() else "cpu"
    return run.accelerator


def check_precision(run: RunConfig, accelerator: str) -> None:
    """A precision the device cannot do is refused, never replaced (the launcher refuses the
    same earlier; this covers a rank started by hand, `train_ae.py`)."""
    if accelerator == "cpu" and run.precision == "16-mixed":
        raise ConfigError([f"precision: {CPU_16_MIXED}"])
    if (
        accelerator == "gpu"
        and run.precision == "bf16-mixed"
        and not torch.cuda.is_bf16_supported()
    ):
        raise ConfigError(
            ["precision: bf16-mixed needs a GPU with bfloat16 (Ampere or newer); use 16-mixed"]
        )


def build_callbacks(cfg: Config, ctx: RankContext, run_ts: str) -> list[L.Callback]:
    """What happens after an optimizer step (EMA, checkpoint, stop signal, sampling, whether to
    validate) is `StepBoundary`'s, in its code order; the callbacks it drives keep only their
    other hooks (setup, resume, epoch ends, validation, their state in the checkpoint), which
    do not depend on their place in this list."""
    ema = EMA(cfg.model.ema_decay) if cfg.model.ema_decay > 0 else None
    checkpointing = Checkpointing(
        cfg.checkpoints, cfg.run.dir, settings=cfg.to_dict(), config_yaml=cfg.to_yaml()
    )
    preemption = Preemption(checkpointing)
    sampling = Sampling(cfg.obs, cfg.run.dir)
    obs = cfg.obs
    callbacks: list[L.Callback] = [
        ClockOffset(),
        EpochSync(),
        PositionSync(),  # on resume: Lightning's loop progress from ae's position
        BadDataBound(cfg.data.max_bad_fraction),
        DebugCallback(
            debug=obs.debug,
            every_train=obs.log_every_n_train_batches,
            every_val=obs.log_every_n_val_batches,
            batch_size=cfg.data.batch_size,
            num_workers=cfg.data.num_workers,
        ),
        *([ema] if ema is not None else []),
        checkpointing,
        preemption,
        sampling,
        # before the step boundary: a rollback is done before anything is saved
        NonFiniteGuard(cfg.optim, cfg.checkpoints, checkpointing.store, cfg.run.precision),
        StepBoundary(
            ema=ema,
            checkpointing=checkpointing,
            preemption=preemption,
            sampling=sampling,
            rank_series=RankSeries(cfg.run.dir.logs, run_ts),
            val_interval=cfg.run.val_interval,
            vote_timeout=timedelta(seconds=cfg.obs.pg_timeout),
        ),
        *metric_callbacks(),
        LossCurve(cfg.run.dir),
    ]
    callbacks = route(callbacks)  # their per-batch hooks through one callback (batch_hooks.py)
    if sys.stderr.isatty() and ctx.rank == 0:
        callbacks.append(RichProgressBar())
    return callbacks


def build_trainer(
    cfg: Config,
    ctx: RankContext,
    run_ts: str,
    logger_runs: dict[str, str],
    resumed_step: int | None = None,
    manual_optimization: bool = False,
) -> L.Trainer:
    """`logger_runs`: the logger runs to continue (those of the checkpoint a run resumes, saved
    after optimizer step `resumed_step`); `manual_optimization`: the model (a LightningModule of
    the user's) steps its optimizers itself, so Lightning cannot clip its gradients: it refused
    the run at its start for --gradient_clip_val's default (`model_build` refuses the flag set
    to another value)."""
    run, optim = cfg.run, cfg.optim
    clip = None if manual_optimization else optim.gradient_clip_val or None
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
            # Parameters unused in a step (the model check names them and this flag).
            find_unused_parameters=optim.find_unused_parameters,
        )
    callbacks = build_callbacks(cfg, ctx, run_ts)
    plugins: list = [AtomicCheckpointIO()]
    if "RANK" in os.environ:
        # The process is described by RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT (torchrun,
        # or the launcher for the rank it starts itself): said explicitly, so that Lightning does
        # not take a SLURM job for its own SLURM layout when no torchrun is in between (which
        # rejects `srun -n2` without --ntasks-per-node, and would install its own SIGUSR1
        # requeue handler in a one-process job's rank).
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
        gradient_clip_val=clip,
        # Lightning asks after every batch; StepBoundary enables validation (limit_val_batches)
        # only on a batch due for it: an epoch's last, and every --val_interval optimizer steps.
        **TRAINER_VALIDATION_ARGS,
        limit_val_batches=1.0 if cfg.data.validates else 0,  # --val_shards=none
        use_distributed_sampler=False,  # the shard plan already splits the data per rank
        num_sanity_val_steps=0,
        logger=build_loggers(cfg.obs, run.dir, run_ts, logger_runs, resumed_step),
        callbacks=callbacks,
        enable_checkpointing=False,  # ae.training.checkpointing saves instead of ModelCheckpoint
        enable_progress_bar=any(isinstance(c, RichProgressBar) for c in callbacks),
        enable_model_summary=False,  # train_ae.py logs it to the train log instead
        default_root_dir=run.output_dir,
        log_every_n_steps=LOG_EVERY_N_STEPS,  # fewer for short runs: metrics.StepsDone
    )
