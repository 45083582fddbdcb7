"""What a rank writes about itself at start: the debug-log header and the train-log setup."""

from __future__ import annotations

import os
import platform
import socket
from pathlib import Path

import lightning
import lightning as L
import torch
from lightning.pytorch.utilities.model_summary import ModelSummary
from loguru import logger

from ae.config import Config
from ae.log_lines import EFFECTIVE_BATCH, RESOLVED_CONFIG, main_log
from ae.lr import effective_lr_line
from logging_cfg import LogPaths, RankContext

_ENV_KEYS = ("MASTER_ADDR", "MASTER_PORT", "CUDA_VISIBLE_DEVICES", "TORCHELASTIC_RUN_ID",
             "SLURM_JOB_ID", "NCCL_DEBUG", "TORCH_DISTRIBUTED_DEBUG", "TORCH_CPP_LOG_LEVEL",
             "OMP_NUM_THREADS")  # fmt: skip


def nccl_available() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_nccl_available()


def device_name(ctx: RankContext, cfg: Config) -> str:
    if torch.cuda.is_available() and cfg.accelerator != "cpu":
        return f"cuda:{ctx.local_rank} ({torch.cuda.get_device_name(ctx.local_rank)})"
    return "cpu"


def log_rank_header(ctx: RankContext, cfg: Config) -> None:
    cuda = torch.cuda.is_available()
    device = device_name(ctx, cfg)
    lines = [
        f"pid={os.getpid()} host={socket.gethostname()} python={platform.python_version()}",
        f"global_rank={ctx.rank} local_rank={ctx.local_rank} node_rank={ctx.node_rank} "
        f"world_size={ctx.world_size}",
        f"device={device} cuda_available={cuda} cuda_devices={torch.cuda.device_count()} "
        f"nccl_available={nccl_available()}",
        f"torch={torch.__version__} lightning={lightning.__version__}",
        *(f"{k}={os.environ.get(k, '<unset>')}" for k in _ENV_KEYS),
    ]
    logger.info("==================== RANK HEADER ====================")
    for line in lines:
        logger.info(line)


def log_run_setup(ctx: RankContext, cfg: Config, paths: LogPaths, train: int, val: int) -> None:
    """Rank 0: setup, effective LR and batch, and the resolved config (train log and
    `<output_dir>/config.yaml`)."""
    if ctx.rank != 0:
        return
    mode = "distributed" if ctx.world_size > 1 else "single process"
    nodes = ctx.world_size // max(1, int(os.environ.get("LOCAL_WORLD_SIZE", ctx.world_size)))
    main_log.info(
        f"Setup: {mode}, world size {ctx.world_size} ({nodes} node(s)), rank {ctx.rank}, "
        f"local rank {ctx.local_rank}, device {device_name(ctx, cfg)}, "
        f"accelerator {cfg.accelerator}, precision {cfg.precision}"
    )
    main_log.info(effective_lr_line(cfg.learning_rate, ctx.world_size, cfg.lr_scale))
    if (cfg.encoder_lr_mult, cfg.decoder_lr_mult) != (1.0, 1.0):
        main_log.info(
            f"Per-module LR: encoder x{cfg.encoder_lr_mult:g}, decoder x{cfg.decoder_lr_mult:g}"
        )
    accum = cfg.gradient_accumulation_steps
    main_log.info(
        EFFECTIVE_BATCH.format(
            batch=cfg.batch_size,
            world=ctx.world_size,
            accum=accum,
            total=cfg.batch_size * ctx.world_size * accum,
        )
    )
    main_log.info(f"Shards: {train} train, {val} val; logs in {paths.logs_dir}")
    config_path = Path(cfg.output_dir) / "config.yaml"
    cfg.write_yaml(config_path)
    main_log.bind(console=False).info(f"{RESOLVED_CONFIG} {config_path}\n" + cfg.to_yaml().rstrip())


def log_model_summary(model: L.LightningModule) -> None:
    main_log.bind(console=False).info(f"Model:\n{ModelSummary(model, max_depth=2)}")
