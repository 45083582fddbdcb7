"""`ae-shards`: make, index and check WebDataset shards for `ae`.

    ae-shards write SRC [SRC ...] OUT_DIR [--prefix train] [--per_shard 1000] [--key NAME]
                    [--compress gz]
        SRC: a .npy array (one sample per row), a .npz file (the array named --key, or its only
        array), or images: folders (.png/.jpg/.jpeg/.webp/.gif/.bmp/.tif below them,
        recursively), image files, or a quoted glob, in sorted order, stored as they are (any
        size and mode). Writes
        OUT_DIR/<prefix>-000000.tar, ... each with its index sidecar; `--compress gz`:
        `.tar.gz` shards, several times fewer bytes for small samples (for shards read over
        http or from object storage; local shards are read fastest plain).
    ae-shards index SPEC [--force] [--jobs N]
        Writes the index sidecar of every local shard of SPEC that lacks a current one, walking
        N shards at a time in N processes.
    ae-shards inspect SPEC [--json] [--input_key FIELD]
        Reads every sample: counts, keys, fields and what they decode to, image sizes and modes,
        index state, every bad sample (input field missing, undecodable, or shaped unlike the
        first good one), and the flags a run on these shards needs. Exits 1 when it finds damage.
    ae-shards bench SPEC [--batch_size B] [--num_workers K] [--seconds S] [--image_size N]
                    [--shard_split drop|pad] [--json]
        Runs the training input pipeline as a rank of a run would and reports samples/s, MB/s
        of shard bytes, the time to the first batch and the raw read rate of the same files.

SPEC is a shard spec as for --train_shards. Bad input exits 2 with one message, no traceback.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import fields
from typing import Any

from loguru import logger
from rich.console import Console

import logging_cfg
from ae.config import DataConfig
from ae.data.shards.spec import split_by_shell
from ae.data.tools.shards import CliError, cmd_bench, cmd_index, cmd_inspect, cmd_write
from ae.errors import UserError


def _run_flag(name: str, kind: type) -> dict[str, Any]:
    """`add_argument` keywords of a run's flag: its default, range and help from `DataConfig`."""
    spec = next(f for f in fields(DataConfig) if f.name == name)
    lo = spec.metadata["lo"]

    def value(text: str) -> object:
        v = kind(text)
        if lo is not None and v < lo:
            raise argparse.ArgumentTypeError(f"must be >= {lo}; got {text}")
        return v

    return {"type": value, "default": spec.default, "help": spec.metadata["help"]}


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="ae-shards", description="Make, index and check WebDataset shards for ae."
    )
    sub = p.add_subparsers(dest="command", required=True)
    w = sub.add_parser("write", help="numpy arrays or an image folder -> shards + index")
    w.add_argument(
        "src", nargs="+",
        help="a .npy / .npz file, or images: folders (every image below), files, a quoted glob",
    )  # fmt: skip
    w.add_argument("out_dir", help="folder for the shards")
    w.add_argument("--prefix", default="train", help="shard name prefix (default: train)")
    w.add_argument("--per_shard", type=int, default=1000, help="samples per shard (1000)")
    w.add_argument("--key", default=None, help="array name inside a .npz with several")
    w.add_argument(
        "--compress", choices=("none", "gz"), default="none",
        help="gz: gzip'd .tar.gz shards, fewer bytes for remote reads (default: none)",
    )  # fmt: skip
    i = sub.add_parser("index", help="write index sidecars for existing local shards")
    i.add_argument("spec", help="shard spec: brace pattern, glob, folder")
    i.add_argument("--force", action="store_true", help="rewrite current indexes too")
    i.add_argument("--jobs", type=int, default=1, help="shards walked in parallel (processes)")
    n = sub.add_parser("inspect", help="counts, keys, sizes and bad samples of shards")
    n.add_argument("spec", help="shard spec: brace pattern, glob, folder, pipe:, http(s)://")
    n.add_argument("--json", action="store_true", help="one JSON list of per-shard reports")
    n.add_argument("--input_key", default=None, help="the field a run would train on (--input_key)")
    b = sub.add_parser("bench", help="samples/s of the training input pipeline on these shards")
    b.add_argument("spec", help="shard spec: brace pattern, glob, folder, pipe:, http(s)://")
    b.add_argument("--batch_size", **_run_flag("batch_size", int))
    b.add_argument("--num_workers", **_run_flag("num_workers", int))
    b.add_argument("--image_size", **_run_flag("image_size", int))
    b.add_argument("--input_key", **_run_flag("input_key", str))
    b.add_argument("--tar_reader", choices=("fast", "tarfile"), **_run_flag("tar_reader", str))
    # drop and pad only: resampled would time whole shards drawn at random, not the counted plan
    b.add_argument(
        "--shard_split", choices=("drop", "pad"), default="drop",
        help="the run's even split: drop the remainder, or pad by repeating samples (drop)",
    )  # fmt: skip
    b.add_argument("--seconds", type=float, default=10.0, help="time this long (10)")
    b.add_argument("--json", action="store_true", help="one JSON object, for scripts")
    return p


COMMANDS = {"write": cmd_write, "index": cmd_index, "inspect": cmd_inspect, "bench": cmd_bench}


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args, extra = parser.parse_known_args(argv)
    if extra:  # the shard files of an unquoted pattern, one argument each: say so
        words = [getattr(args, "spec", None) or "", *extra]
        if (hint := split_by_shell(words)) is None:
            parser.error(f"unrecognized arguments: {' '.join(extra)}")  # exits 2
        logging_cfg.configure_console()
        logger.error(f"ae-shards {args.command}: {hint}")
        return 2
    # bench: the pipeline's per-epoch lines would drown the figures; problems still show
    # (and each bad sample once: every epoch reads it again)
    bench = args.command == "bench"
    logging_cfg.configure_console("WARNING" if bench else "INFO", once=bench)
    # Piped output is read by people later too: do not squeeze tables to 80 columns there.
    console = Console(highlight=False, width=None if sys.stdout.isatty() else 160)
    try:
        if getattr(args, "per_shard", 1) < 1:
            raise CliError(f"--per_shard: must be >= 1; got {args.per_shard}")
        if getattr(args, "jobs", 1) < 1:
            raise CliError(f"--jobs: must be >= 1; got {args.jobs}")
        return COMMANDS[args.command](args, console)
    except UserError as e:
        logger.error(f"ae-shards {args.command}: {e.render()}")
        return e.exit_code
    except OSError as e:  # unwritable output folder, disk full...
        logger.error(f"ae-shards {args.command}: {e}")
        return 2


if __name__ == "__main__":
    sys.exit(main())
