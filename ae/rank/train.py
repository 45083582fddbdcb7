"""One rank of a training run, top to bottom: logging -> config -> data -> model -> fit -> clean up.

torchrun starts it in every rank through `ae.cli.rank_process` (which first sends the process's
native output to its log; `train_ae.py` calls the same); run directly that trains in a single
process: `python -m ae.cli.rank_process --help`.
"""

from __future__ import annotations

import math
import os

import lightning as L
import torch
from torch.distributed.elastic.multiprocessing.errors import record

import logging_cfg
from ae.config import PREFETCH_FACTOR, Config, parse_config
from ae.data.datamodule import ShardDataModule
from ae.data.shards.demo import with_demo_defaults
from ae.data.shards.spec import resolve_shards
from ae.data.stream.loader import install_worker_reaper
from ae.errors import ResourceLimitError
from ae.forensics import flight_recorder
from ae.forensics.step_times import step_times
from ae.forensics.watchdog import start_watchdog
from ae.job.preflight import judge, rank_needs
from ae.job.rank_env import LAUNCHER_ENV, RESTART_ENV, RESUME_NOTE_ENV, restart_checkpoint
from ae.log_lines import GAN_STATS_FILE, RESOURCE_TIGHT, TRAINING_FINISHED, main_log
from ae.rank.exit import run_to_exit
from ae.stragglers import recent_window_s
from ae.training.inception import load_fid
from ae.training.metrics import start_loggers
from ae.training.model import AutoEncoder
from ae.training.model_build import build_model
from ae.training.model_check import forward_not_called, naming_unused_parameters
from ae.training.objective import load_perceptual
from ae.training.position.resume_source import nothing_left, open_resume
from ae.training.preemption import preempted_at
from ae.training.startup_header import describe, log_model_summary, log_rank_header, log_run_setup
from ae.training.trainer import build_trainer
from logging_cfg import RankContext


def fit(cfg: Config, ctx: RankContext) -> str:
    """Train; returns how training ended."""
    run_ts = logging_cfg.resolve_run_ts(ctx)
    run_dir, obs = cfg.run.dir, cfg.obs
    paths = logging_cfg.configure(
        run_dir.logs, run_ts, ctx, debug=obs.debug, rotate_mb=obs.log_rotate_mb,
        rotate_keep=obs.log_rotate_keep, native_output=True,
        fatal_on_console=LAUNCHER_ENV not in os.environ,  # the launcher prints the diagnosis
    )  # fmt: skip
    install_worker_reaper()
    flight_recorder.enable(paths.logs_dir, ctx.rank, run_ts)  # before the process group exists
    start_watchdog(
        obs.stall_timeout, cfg.run.accelerator, ctx, paths, run_ts,
        straggler_factor=obs.straggler_factor, straggler_window=obs.straggler_window,
        hang_timeout=obs.hang_timeout,
    )  # fmt: skip
    if ctx.rank == 0 and (restart := os.environ.get(RESTART_ENV)):
        main_log.bind(console=False).warning(restart)  # the launcher printed it already
    if ctx.rank == 0 and (note := os.environ.get(RESUME_NOTE_ENV)):
        main_log.bind(console=False).info(note)  # the launcher printed it already
    log_rank_header(ctx, cfg.run.accelerator)
    train_urls, val_urls = resolve_shards(
        *with_demo_defaults(cfg.data.train_shards, cfg.data.val_shards)
    )
    val = f"{len(val_urls)} val" if val_urls is not None else "val held out of train"
    log_run_setup(ctx, cfg, paths, len(train_urls), val if cfg.data.validates else "no val")
    L.seed_everything(cfg.run.seed, verbose=False)

    datamodule = ShardDataModule(
        cfg.data, train_urls, val_urls, seed=cfg.run.seed, debug=obs.debug, rank=ctx.rank
    )
    # What the heartbeat's step clock reports: its recent window and the train loader's workers.
    step_times.configure(recent_window_s(obs.straggler_window), datamodule.train_worker_rates)
    # Before the trainer and any dataloader worker: a model that cannot be built, or that fails
    # on real samples as validation computes on them, is one message. The input is probed from
    # the first samples here (the data module's constructor reads no shard).
    datamodule.probe()
    first = datamodule.first_samples()
    model, latent = build_model(
        datamodule.spec, cfg.model, cfg.optim, ctx.world_size, batch=first,
        objective=cfg.objective,
    )  # fmt: skip
    if isinstance(model, AutoEncoder):
        # Before any dataloader worker: a missing or wrong weights file is one message, exit 2.
        if (lpips := load_perceptual(cfg.objective)) is not None:
            model.attach_perceptual(lpips)
        if (inception := load_fid(cfg.objective, datamodule.spec)) is not None:
            model.attach_fid(inception)
        model.recipe.stats_file = paths.logs_dir / GAN_STATS_FILE.format(rank=ctx.rank, ts=run_ts)
    if ctx.rank == 0:
        main_log.info(describe(model, datamodule.spec, latent))
        if (note := forward_not_called(model, first)) is not None:
            main_log.warning(note)
        log_model_summary(model)
    preflight(cfg, ctx, batch_bytes=cfg.data.batch_size * math.prod(datamodule.spec.shape) * 4,
              model=model)  # fmt: skip
    # weights_only: the safe loader (ae.training.position.checkpoint_read), unless trusted.
    trust = cfg.checkpoints.trust_checkpoint
    # Before Lightning loads it: a damaged file or another model is one message, exit 2.
    source = open_resume(
        cfg.checkpoints.resume_from_checkpoint, run_dir.checkpoints, cfg.to_dict(), model,
        trust=trust, expected=restart_checkpoint(os.environ.get(RESTART_ENV)),
    )  # fmt: skip
    if source is not None:
        # Before the data is planned (in `trainer.fit`): the resumed run's hold-out, kept.
        datamodule.resume_plan(source.data_state(datamodule))
    resumed = (source.path, source.step) if source is not None else None
    # Rank 0 alone writes metrics: it continues the logger runs of the checkpoint it resumes.
    runs = source.logger_runs() if source is not None and ctx.rank == 0 else {}
    manual = not model.automatic_optimization  # a LightningModule of the user's
    at = resumed[1] if resumed is not None else None
    trainer = build_trainer(cfg, ctx, run_ts, runs, at, manual_optimization=manual)
    if ctx.rank == 0:
        start_loggers(trainer.loggers)  # one that cannot start stops the run now, exit 2
    ckpt = source.path if source is not None else None
    del source  # Lightning reads the file again (its own restore); free this copy first
    with naming_unused_parameters(model):  # DDP's error, as the flag that avoids it
        trainer.fit(model, datamodule=datamodule, ckpt_path=ckpt, weights_only=not trust)
    if (step := preempted_at(trainer)) is not None:
        return f"preempted at step {step}; resume with --resume_from_checkpoint=last"
    main_log.info(TRAINING_FINISHED.format(step=trainer.global_step, limit=reached(trainer, cfg)))
    if resumed is not None and trainer.global_step == resumed[1] and ctx.rank == 0:
        main_log.info(nothing_left(*resumed, cfg.run.max_steps, cfg.run.max_epochs))
    return "training finished"


def reached(trainer: L.Trainer, cfg: Config) -> str:
    """Which limit ended the training (the TRAINING_FINISHED line's `limit`): a run of
    `--max_steps=20` that ends at step 15 ended on `--max_epochs`, which a user may not have set."""
    run = cfg.run
    if 0 <= run.max_steps <= trainer.global_step:
        return f" (--max_steps={run.max_steps} reached)"
    if 0 <= run.max_epochs <= trainer.current_epoch:
        return f" (--max_epochs={run.max_epochs} reached)"
    return ""


def preflight(cfg: Config, ctx: RankContext, *, batch_bytes: int, model: torch.nn.Module) -> None:
    """The machine's limits against this run's measured needs (`ae.job.preflight`), on every
    rank (each stops on a limit that cannot work, naming the tight ones too); otherwise local rank
    0 warns about tight ones, the only such warning of the run (the launcher's preflight only
    stops)."""
    state_bytes = sum(
        t.numel() * t.element_size() for t in model.state_dict().values() if torch.is_tensor(t)
    )
    problems, tight = judge(
        rank_needs(
            cfg, batch_bytes=batch_bytes, state_bytes=state_bytes, world_size=ctx.world_size,
            local_ranks=int(os.environ.get("LOCAL_WORLD_SIZE", 1)), prefetch=PREFETCH_FACTOR,
        )
    )  # fmt: skip
    tight = [RESOURCE_TIGHT.format(problem=line) for line in tight]
    if problems:  # every rank says it all: the first to refuse ends the others before they speak
        raise ResourceLimitError(problems, tight)
    if ctx.local_rank == 0:
        for line in tight:
            main_log.warning(line)


@record  # the traceback goes into torchrun's error file, so its failure report shows it
def main(argv: list[str]) -> int:
    ctx = RankContext.from_env()
    return run_to_exit(lambda: fit(parse_config(argv), ctx))
