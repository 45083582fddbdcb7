"""One rank of `ae-encode`, top to bottom: logging -> shard plan -> model -> encode -> totals.

torchrun starts it in every rank through `ae.cli.encode_rank` (`ae.job.encode` is the launcher);
run directly that encodes in one process: `python -m ae.cli.encode_rank CKPT SPEC OUT_DIR ...`.
The ranks share no model and
make no collective call while encoding: a gloo process group is there only for the shard counts
(each rank counts a share, one all-gather) and the totals at the end (one all-reduce).
"""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from loguru import logger
from torch.distributed.elastic.multiprocessing.errors import record

import logging_cfg
from ae.data.planning.counts import count_cache_dir, shared_counts
from ae.data.planning.plan import assign_shards
from ae.data.shards.spec import expand_shards
from ae.data.stream.encode_stream import KEEP_ALL, WholeShards
from ae.data.stream.loader import PreemptibleLoader, install_worker_reaper
from ae.forensics.progress import in_phase, progress
from ae.forensics.watchdog import start_watchdog
from ae.job.encode_args import EncodeArgs, output_paths, parse_args
from ae.job.encode_outputs import skipped_outputs
from ae.log_lines import ENCODE_DONE, ENCODE_PLAN, ENCODE_RANK_DONE, ENCODE_SKIPPED, main_log
from ae.rank.exit import run_to_exit
from ae.training.encoding import (
    EncodeError,
    OutputShards,
    encode_all,
    load_checkpoint,
    model_from_checkpoint,
    probe_inputs,
    uses_ema,
)
from ae.training.startup_header import describe, log_rank_header
from logging_cfg import RankContext


def _device(args: EncodeArgs, ctx: RankContext) -> torch.device:
    if args.accelerator != "cpu" and torch.cuda.is_available():
        return torch.device("cuda", ctx.local_rank)
    return torch.device("cpu")


def _totals(values: list[int]) -> list[int]:
    """The sums over ranks (one all-reduce; the values themselves on a single process)."""
    if not dist.is_initialized():
        return values
    t = torch.tensor(values, dtype=torch.int64)
    dist.all_reduce(t)
    return [int(v) for v in t]


def _all_gather(mine: dict) -> list[dict]:
    """Every rank's dict, in rank order (one all-gather; just `mine` in one process)."""
    if not dist.is_initialized():
        return [mine]
    parts: list[dict] = [{}] * dist.get_world_size()
    dist.all_gather_object(parts, mine)
    return parts


def encode(args: EncodeArgs, ctx: RankContext) -> str:
    run_ts = logging_cfg.resolve_run_ts(ctx)
    paths = logging_cfg.configure(args.logs, run_ts, ctx, debug=args.debug, native_output=True)
    install_worker_reaper()
    start_watchdog(args.stall_timeout, args.accelerator, ctx, paths, run_ts)
    log_rank_header(ctx, args.accelerator)
    # First: a checkpoint the safe loader refuses ends the rank before anything else starts.
    ckpt = load_checkpoint(Path(args.ckpt), trust=args.trust_checkpoint)
    if ctx.world_size > 1:
        # gloo whatever the device: only two small CPU collectives, never a tensor of the model
        dist.init_process_group("gloo", timeout=timedelta(seconds=args.pg_timeout))
    log = main_log if ctx.rank == 0 else logger

    with in_phase("shard planning"):
        urls = expand_shards(args.spec, "SPEC")
        outs = output_paths(urls, Path(args.out_dir))
        # Rank 0 looks (two small reads per output), every rank plans by what it found: the
        # same shards on every rank (no rank writes before this gather).
        looked = (
            skipped_outputs(urls, outs, Path(args.out_dir), overwrite=args.overwrite)
            if ctx.rank == 0
            else []
        )
        skipped = set(_all_gather({"skip": looked})[0]["skip"])
        if skipped:
            (main_log.bind(console=False) if ctx.rank == 0 else logger).info(
                ENCODE_SKIPPED.format(skipped=len(skipped), shards=len(urls), out=args.out_dir)
            )
        todo = [i for i in range(len(urls)) if i not in skipped]
        counts = shared_counts(
            "input", [urls[i] for i in todo], count_cache_dir("auto"), rank=ctx.rank,
            world_size=ctx.world_size, gather=_all_gather,
        ).counts  # fmt: skip
        mine = [todo[j] for j in assign_shards(counts, ctx.world_size)[ctx.rank]]
        planned = dict(zip(todo, counts, strict=True))
        log.info(
            ENCODE_PLAN.format(
                shards=len(todo), samples=sum(counts), ranks=ctx.world_size,
                rank_shards=len(mine), rank_samples=sum(planned[i] for i in mine),
            )
        )  # fmt: skip
        # Which input shards this rank encodes (the debug log only: a long line for many).
        logger.info(f"Shards of this rank: {', '.join(urls[i] for i in mine) or 'none'}")
    with in_phase("shard planning"):
        # Inputs decoded as the training run decoded them (its field, mode, image size).
        decoder = probe_inputs(ckpt, urls, args.ckpt)
        spec = decoder.spec
    module, latent = model_from_checkpoint(ckpt, spec, args.ckpt)
    weights = "EMA weights" if uses_ema(ckpt) else "weights"
    log.info(f"Encoding with {args.ckpt} (step {ckpt.get('global_step', '?')}, {weights})")
    log.info(describe(module, spec, latent, training=False))
    del ckpt

    dataset = WholeShards(
        urls, mine, decoder, args.batch_size, args.num_workers, args.keep, args.tar_reader, planned
    )
    loader = PreemptibleLoader(
        dataset,
        batch_size=None,  # the dataset yields whole batches of one shard
        num_workers=args.num_workers,
        prefetch_factor=4 if args.num_workers else None,
    )
    rank_samples = sum(planned[i] for i in mine)
    outputs = OutputShards(
        urls, outs, args.field, args.dtype, planned=(len(mine), rank_samples),
        report=log.info,
    )  # fmt: skip
    progress.enter("data loading", step=0)
    seconds = encode_all(module, loader, outputs, _device(args, ctx))
    logger.info(
        ENCODE_RANK_DONE.format(
            samples=outputs.samples, shards=outputs.shards,
            bad=rank_samples - outputs.samples, seconds=f"{seconds:.2f}",
        )
    )  # fmt: skip
    dataset.errors.log_summary("input")
    (samples, shards) = _totals([outputs.samples, outputs.shards])
    parts = _all_gather({"damaged": outputs.damaged, "kept": sorted(outputs.kept)})
    damaged = [url for part in parts for url in part["damaged"]]
    # A --keep_fields name that no sample has (a typo, `cls` for `class`): nothing was copied
    missing = sorted(args.keep - {KEEP_ALL} - {f for part in parts for f in part["kept"]})
    if ctx.rank == 0:
        # Every sample of the plan not written is counted: bad ones, and those of input shards
        # that could not be read to their end (their outputs are not written).
        main_log.log(
            "WARNING" if samples < sum(counts) else "INFO",
            ENCODE_DONE.format(
                samples=samples, planned=sum(counts), bad=sum(counts) - samples, shards=shards,
                out=args.out_dir, field=args.field, dtype=args.dtype,
                shape="x".join(map(str, latent)),
            ),
        )  # fmt: skip
        if missing and samples:
            main_log.warning(
                f"keep_fields: no input sample has a field {', '.join(missing)}: nothing of it "
                "was copied (fields are named as WebDataset names them: 000123.cls.txt -> "
                "cls.txt; ae-shards inspect SPEC lists them)"
            )
        if damaged:
            raise EncodeError(_damaged_message(damaged, shards, args.out_dir))
    return "encoding finished"


def _damaged_message(damaged: list[str], written: int, out_dir: str) -> str:
    names = ", ".join(damaged[:5]) + (f" and {len(damaged) - 5} more" if len(damaged) > 5 else "")
    return (
        f"SPEC: {len(damaged)} input shard(s) could not be read to their end: {names} (grep "
        f'"Bad shard" {out_dir}/logs/train_*.log says where); their outputs are not written, the '
        f"other {written} are. Replace or remove those inputs, then run the same command again: "
        "it skips the complete outputs"
    )


@record  # the traceback goes into torchrun's error file, so its failure report shows it
def main(argv: list[str]) -> int:
    ctx = RankContext.from_env()
    return run_to_exit(lambda: encode(parse_args(argv), ctx))
