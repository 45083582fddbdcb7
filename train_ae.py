"""Train an autoencoder on WebDataset shards: logging -> config -> build -> fit -> clean up.

Run through ./train_ae.sh (torchrun), or directly for a single process: python train_ae.py --help
"""

from __future__ import annotations

import sys

import lightning as L
import torch.distributed as dist
from loguru import logger
from torch.distributed.elastic.multiprocessing.errors import record

import logging_cfg
from ae.config import Config, ConfigError, help_text, parse_config
from ae.datamodule import DataError, ShardDataModule
from ae.log_lines import RANK_EXIT
from ae.lr import scale_lr
from ae.model import AutoEncoder
from ae.progress import progress
from ae.run_info import log_model_summary, log_rank_header, log_run_setup
from ae.shard_spec import ShardSpecError, resolve_shards
from ae.trainer import build_trainer
from ae.watchdog import start_watchdog, stop_watchdog
from logging_cfg import RankContext


def fit(cfg: Config, ctx: RankContext) -> None:
    run_ts = logging_cfg.resolve_run_ts(ctx)
    paths = logging_cfg.configure(
        cfg.logs_dir, run_ts, ctx, debug=cfg.debug, rotate_mb=cfg.log_rotate_mb,
        rotate_keep=cfg.log_rotate_keep, native_output=True,
    )  # fmt: skip
    start_watchdog(cfg, ctx, paths, run_ts)
    log_rank_header(ctx, cfg)
    train_urls, val_urls = resolve_shards(cfg.train_shards, cfg.val_shards)
    log_run_setup(ctx, cfg, paths, len(train_urls), len(val_urls))
    L.seed_everything(cfg.seed, verbose=False)

    datamodule = ShardDataModule(cfg, train_urls, val_urls)
    model = AutoEncoder(
        datamodule.spec,
        hidden_dim=cfg.hidden_dim,
        latent_dim=cfg.latent_dim,
        learning_rate=scale_lr(cfg.learning_rate, ctx.world_size, cfg.lr_scale),
        weight_decay=cfg.weight_decay,
        warmup_steps=cfg.warmup_steps,
        lr_scheduler=cfg.lr_scheduler,
    )
    if ctx.rank == 0:
        log_model_summary(model)
    trainer = build_trainer(cfg, ctx)
    trainer.fit(model, datamodule=datamodule)
    logger.bind(main=True).info(f"Training finished at step {trainer.global_step}")


@record  # the traceback goes into torchrun's error file, so its failure report shows it
def main(argv: list[str]) -> int:
    if "--help" in argv or "-h" in argv:
        logging_cfg.configure_console()
        logger.info(help_text())
        return 0
    ctx = RankContext.from_env()
    try:
        cfg = parse_config(argv)
        fit(cfg, ctx)
    except (ConfigError, ShardSpecError, DataError) as e:
        # User mistakes: one clear message, no traceback (the launcher catches most earlier).
        text = e.render() if isinstance(e, ConfigError) else str(e)
        if not logging_cfg.is_configured():
            logging_cfg.configure_console()
        logger.error(text)
        code, why = 2, type(e).__name__
    else:
        code, why = 0, "training finished"
    finally:
        progress.enter("teardown")
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
        stop_watchdog()
    # The last line of a rank that ends on its own: ae-diagnose tells it from a killed one.
    logger.info(RANK_EXIT.format(code=code, why=why))
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
