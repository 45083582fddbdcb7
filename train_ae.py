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
from ae.checkpoint_files import resolve_resume
from ae.config import Config, ConfigError, help_text, parse_config
from ae.datamodule import DataError, ShardDataModule
from ae.log_lines import RANK_EXIT, main_log
from ae.model import AutoEncoder
from ae.preemption import preempted_at
from ae.progress import progress
from ae.run_info import log_model_summary, log_rank_header, log_run_setup
from ae.shard_spec import ShardSpecError, resolve_shards
from ae.trainer import build_trainer
from ae.watchdog import start_watchdog, stop_watchdog
from logging_cfg import RankContext


def fit(cfg: Config, ctx: RankContext) -> str:
    """Train; returns how training ended."""
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
    model = AutoEncoder.from_config(datamodule.spec, cfg, ctx.world_size)
    if ctx.rank == 0:
        log_model_summary(model)
    trainer = build_trainer(cfg, ctx, run_ts)
    ckpt = resolve_resume(cfg.resume_from_checkpoint, cfg.checkpoints_dir)
    # Our own checkpoints: they hold the config and loop state, not only tensors.
    trainer.fit(model, datamodule=datamodule, ckpt_path=ckpt, weights_only=False)
    if (step := preempted_at(trainer)) is not None:
        return f"preempted at step {step}; resume with --resume_from_checkpoint=last"
    main_log.info(f"Training finished at step {trainer.global_step}")
    return "training finished"


@record  # the traceback goes into torchrun's error file, so its failure report shows it
def main(argv: list[str]) -> int:
    if "--help" in argv or "-h" in argv:
        logging_cfg.configure_console()
        logger.info(help_text())
        return 0
    ctx = RankContext.from_env()
    try:
        cfg = parse_config(argv)
        why = fit(cfg, ctx)
    except (ConfigError, ShardSpecError, DataError) as e:
        # User mistakes: one clear message, no traceback (the launcher catches most earlier).
        text = e.render() if isinstance(e, ConfigError) else str(e)
        text = e.brief() if isinstance(e, DataError) else text
        if not logging_cfg.is_configured():
            logging_cfg.configure_console()
        logger.error(text)
        code, why = 2, type(e).__name__
    else:
        code = 0
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
