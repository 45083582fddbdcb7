"""What a rank writes about itself at start: the debug-log header and the train-log setup."""

from __future__ import annotations

import importlib.metadata
import math
import os
import platform
import socket
from pathlib import Path

import lightning
import lightning as L
import torch
from lightning.pytorch.utilities.model_summary import ModelSummary
from loguru import logger

import ae
from ae.config import Config
from ae.data.decoding.decode import InputSpec
from ae.data.shards.demo import is_demo
from ae.log_lines import EFFECTIVE_BATCH, RANK_PROCESS, RESOLVED_CONFIG, main_log
from ae.training.lr import effective_lr_line
from ae.training.model import AutoEncoder
from logging_cfg import LogPaths, RankContext

_ENV_KEYS = ("MASTER_ADDR", "MASTER_PORT", "GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME",
             "CUDA_VISIBLE_DEVICES", "TORCHELASTIC_RUN_ID",
             "SLURM_JOB_ID", "NCCL_DEBUG", "TORCH_DISTRIBUTED_DEBUG", "TORCH_CPP_LOG_LEVEL",
             "OMP_NUM_THREADS")  # fmt: skip


def nccl_available() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_nccl_available()


def device_name(ctx: RankContext, accelerator: str) -> str:
    if torch.cuda.is_available() and accelerator != "cpu":
        return f"cuda:{ctx.local_rank} ({torch.cuda.get_device_name(ctx.local_rank)})"
    return "cpu"


def ae_version() -> str:
    """The installed version, or `source` when `ae` runs from a checkout on PYTHONPATH (no
    package metadata): the header must never be what stops a rank."""
    try:
        return importlib.metadata.version("ae")
    except importlib.metadata.PackageNotFoundError:
        return "source"


def log_rank_header(ctx: RankContext, accelerator: str) -> None:
    cuda = torch.cuda.is_available()
    device = device_name(ctx, accelerator)
    lines = [
        RANK_PROCESS.format(
            pid=os.getpid(), host=socket.gethostname(), python=platform.python_version()
        ),
        f"global_rank={ctx.rank} local_rank={ctx.local_rank} node_rank={ctx.node_rank} "
        f"world_size={ctx.world_size}",
        f"device={device} cuda_available={cuda} cuda_devices={torch.cuda.device_count()} "
        f"nccl_available={nccl_available()}",
        f"torch={torch.__version__} lightning={lightning.__version__} "
        f"ae={ae_version()} ({Path(ae.__file__).parent})",
        *(f"{k}={os.environ.get(k, '<unset>')}" for k in _ENV_KEYS),
    ]
    logger.info("==================== RANK HEADER ====================")
    for line in lines:
        logger.info(line)


def log_run_setup(ctx: RankContext, cfg: Config, paths: LogPaths, train: int, val: str) -> None:
    """Rank 0: setup, effective LR and batch, and the resolved config (into the train log)."""
    if ctx.rank != 0:
        return
    run, optim = cfg.run, cfg.optim
    mode = "distributed" if ctx.world_size > 1 else "single process"
    nodes = ctx.world_size // max(1, int(os.environ.get("LOCAL_WORLD_SIZE", ctx.world_size)))
    main_log.info(
        f"Setup: {mode}, world size {ctx.world_size} ({nodes} node(s)), rank {ctx.rank}, "
        f"local rank {ctx.local_rank}, device {device_name(ctx, run.accelerator)}, "
        f"accelerator {run.accelerator}, precision {run.precision}"
    )
    main_log.info(effective_lr_line(optim.learning_rate, ctx.world_size, optim.lr_scale))
    if (optim.encoder_lr_mult, optim.decoder_lr_mult) != (1.0, 1.0):
        main_log.info(
            f"Per-module LR: encoder x{optim.encoder_lr_mult:g}, decoder x{optim.decoder_lr_mult:g}"
        )
    accum, batch = optim.gradient_accumulation_steps, cfg.data.batch_size
    main_log.info(
        EFFECTIVE_BATCH.format(
            batch=batch,
            world=ctx.world_size,
            accum=accum,
            total=batch * ctx.world_size * accum,
        )
    )
    # An unset --train_shards trains the demo digits (the launcher names them to the ranks):
    # said on the console, or a forgotten spec passes unseen.
    demo = " (the demo digits: no --train_shards given)" if is_demo(cfg.data.train_shards) else ""
    main_log.info(f"Shards: {train} train{demo}, {val}; logs in {paths.logs_dir}")
    # The same goes to `config_path` once training starts (`ae.training.checkpointing`).
    config_path = run.dir.config_yaml
    main_log.bind(console=False).info(f"{RESOLVED_CONFIG} {config_path}\n" + cfg.to_yaml().rstrip())


def log_model_summary(model: L.LightningModule) -> None:
    main_log.bind(console=False).info(f"Model:\n{ModelSummary(model, max_depth=2)}")


def describe(
    module: L.LightningModule, spec: InputSpec, latent: tuple[int, ...] | None,
    training: bool = True,
) -> str:  # fmt: skip
    """`Model: resnet, 771,123 parameters, latent 4x8x8 (256 numbers, 48x fewer than the
    input)`; with `training`, the losses that train it too (LPIPS, the discriminator: ae-encode
    loads them with the checkpoint and never runs them)."""
    if not isinstance(module, AutoEncoder):
        name = f"{type(module).__module__}:{type(module).__qualname__} (LightningModule)"
    elif module.net is not None:
        name = f"{type(module.net).__module__}:{type(module.net).__qualname__}"
    else:
        name = module.hparams["model"]
    d = getattr(module, "discriminator", None)
    d_params = sum(p.numel() for p in d.parameters()) if d is not None else 0
    params = sum(p.numel() for p in module.parameters()) - d_params
    text = f"Model: {name}, {params:,} parameters"
    if latent:
        n, inputs = math.prod(latent), math.prod(spec.shape)
        ratio = (f"{inputs / n:.3g}x fewer than the input" if n < inputs else
                 "as many as the input: no compression" if n == inputs else
                 f"{n / inputs:.3g}x more than the input: no compression")  # fmt: skip
        text += f", latent {'x'.join(map(str, latent))} ({n} numbers, {ratio})"
    if isinstance(module, AutoEncoder) and module.kl_weight > 0:
        text += f", VAE (kl_weight {module.kl_weight:g})"
    if isinstance(module, AutoEncoder) and training:
        hp = module.hparams
        if hp.perceptual_weight > 0:
            text += f", LPIPS (perceptual_weight {hp.perceptual_weight:g})"
        if d is not None:
            text += f", PatchGAN discriminator ({d_params:,} parameters) from step {hp.disc_start}"
    return text
