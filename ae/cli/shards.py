"""`ae-shards`: make, index and check WebDataset shards for `ae`.

    ae-shards write SRC OUT_DIR [--prefix train] [--per_shard 1000] [--key NAME]
        SRC: a .npy array (one sample per row), a .npz file (the array named --key, or its only
        array), or a folder of images (.png/.jpg/.jpeg/.webp/.gif/.bmp/.tif, recursively, in
        sorted order, stored as they are: any size and mode). Writes
        OUT_DIR/<prefix>-000000.tar, ... each with its index sidecar.
    ae-shards index SPEC [--force] [--jobs N]
        Writes the index sidecar of every local shard of SPEC that lacks a current one, walking
        N shards at a time in N processes.
    ae-shards inspect SPEC [--json] [--input_key FIELD]
        Reads every sample: counts, keys, fields and what they decode to, image sizes and modes,
        index state, every bad sample (input field missing, undecodable, or shaped unlike the
        first good one), and the flags a run on these shards needs. Exits 1 when it finds damage.

SPEC is a shard spec as for --train_shards. Bad input exits 2 with one message, no traceback.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict
from pathlib import Path

import numpy as np
from loguru import logger
from rich.console import Console
from rich.progress import Progress

import logging_cfg
from ae.cli.inspect_shards import Inspector, print_reports
from ae.data.header_walk import scan_shard
from ae.data.index import read_index, write_index
from ae.data.spec import expand_shards, is_remote
from ae.data.writer import Sample, npy_bytes, write_shards
from ae.errors import UserError

# Photo formats taken from a folder; each sample's field is its file's extension (`jpg`, `png`),
# and a run takes any image extension as the input field by default.
IMAGE_EXTS = (".png", ".jpg", ".jpeg", ".webp", ".gif", ".bmp", ".tif", ".tiff")


class CliError(UserError):
    """Bad input: reported as one line, exit status 2."""


def _progress(console: Console) -> Progress:
    """A progress bar on a terminal; nothing in a pipe or a log file."""
    return Progress(console=console, transient=True, disable=not console.is_terminal)


# --- write ----------------------------------------------------------------------------------
def _load_array(src: Path, key: str | None) -> np.ndarray:
    try:  # a .npy is memory-mapped (rows are read as they are written); a .npz is lazy
        data = np.load(src, mmap_mode="r", allow_pickle=False)
    except Exception as e:  # a user file can be broken in many ways: all mean "not numpy"
        raise CliError(f"{src}: not a readable numpy file: {e}") from None
    if isinstance(data, np.lib.npyio.NpzFile):
        with data:
            names = list(data.files)
            if key is None and len(names) != 1:
                raise CliError(f"{src}: holds arrays {names}; pick one with --key")
            if (key or names[0]) not in names:
                raise CliError(f"{src}: no array {key!r}; it holds {names}")
            data = data[key or names[0]]
    if data.ndim < 1 or len(data) == 0:
        raise CliError(f"{src}: needs an array with at least one row; got shape {data.shape}")
    return data


def _source_samples(src: Path, key: str | None) -> tuple[int, Iterator[Sample]]:
    """(count, samples) of a numpy file or an image folder; keys are 8-digit indices."""
    if src.is_dir():
        files = sorted(p for p in src.rglob("*") if p.suffix.lower() in IMAGE_EXTS)
        if not files:
            raise CliError(f"{src}: no {'/'.join(IMAGE_EXTS)} files below this folder")
        return len(files), (
            {
                "__key__": f"{i:08d}".encode(),
                p.suffix.lower()[1:]: p.read_bytes(),
                "path": str(p.relative_to(src)).encode(),  # to trace a bad sample back
            }
            for i, p in enumerate(files)
        )
    if src.suffix in (".npy", ".npz") and src.is_file():
        array = _load_array(src, key)
        return len(array), (
            {"__key__": f"{i:08d}".encode(), "npy": npy_bytes(row)} for i, row in enumerate(array)
        )
    raise CliError(f"{src}: expected a .npy or .npz file or a folder of images")


def cmd_write(args: argparse.Namespace, console: Console) -> int:
    src, out = Path(args.src), Path(args.out_dir)
    if not src.exists():
        raise CliError(f"{src}: no such file or folder")
    if any(out.glob(f"{args.prefix}-*.tar")):
        # Fewer new shards than old ones would leave stale shards that a folder spec picks up.
        raise CliError(f"{out} already holds {args.prefix}-*.tar shards; use another folder")
    total, samples = _source_samples(src, args.key)
    with _progress(console) as bar:
        task = bar.add_task(f"writing {total} samples", total=total)

        def counted() -> Iterator[Sample]:
            for sample in samples:
                yield sample
                bar.advance(task)

        paths = write_shards(out, args.prefix, counted(), args.per_shard)
    pattern = f"{out}/{args.prefix}-{{000000..{len(paths) - 1:06d}}}.tar"
    console.print(f"Wrote {total} samples into {len(paths)} shards (+ .idx sidecars) in {out}")
    console.print(f"Train on them with --train_shards='{pattern}'")
    return 0


# --- index ----------------------------------------------------------------------------------
def _local_urls(spec: str) -> list[str]:
    urls = expand_shards(spec, "shards")
    remote = [u for u in urls if is_remote(u)]
    if remote:
        raise CliError(
            f"index writes sidecars next to the shards, so they must be local; {remote[0]} is not."
            " Index the shards where they are written, then upload the .idx files beside them"
        )
    return urls


def _index_one(url: str) -> str | None:
    """Walk one shard and write its sidecar; the damage found instead, if any."""
    scan = scan_shard(url)
    if scan.error is None:
        write_index(Path(url), scan.samples, scan.offsets)
    return scan.error


def cmd_index(args: argparse.Namespace, console: Console) -> int:
    urls = _local_urls(args.spec)
    todo = [u for u in urls if args.force or read_index(u) is None]
    written = damaged = 0
    with contextlib.ExitStack() as stack:
        bar = stack.enter_context(_progress(console))
        pool = stack.enter_context(ProcessPoolExecutor(args.jobs)) if args.jobs > 1 else None
        results = pool.map(_index_one, todo) if pool else map(_index_one, todo)
        described = f"indexing {len(todo)} shards on {args.jobs} process(es)"
        tracked = bar.track(results, len(todo), description=described)
        for url, error in zip(todo, tracked, strict=True):
            if error is not None:
                logger.error(f"{url}: not indexed: {error}")
                damaged += 1
            else:
                written += 1
    kept = len(urls) - len(todo)
    console.print(f"{written} indexed, {kept} already had a current index, {damaged} damaged")
    return 1 if damaged else 0


# --- inspect ---------------------------------------------------------------------------------
def cmd_inspect(args: argparse.Namespace, console: Console) -> int:
    urls = expand_shards(args.spec, "shards")
    inspector = Inspector(args.input_key)
    with _progress(console) as bar:
        reports = [inspector.shard(u) for u in bar.track(urls, description="reading shards")]
    damaged = sum(bool(r.bad or r.error) for r in reports)
    if args.json:
        sys.stdout.write(json.dumps([asdict(r) for r in reports], indent=1) + "\n")
    else:
        print_reports(console, reports, inspector.hints(reports))
    return 1 if damaged else 0


# --- entry point ----------------------------------------------------------------------------
def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="ae-shards", description="Make, index and check WebDataset shards for ae."
    )
    sub = p.add_subparsers(dest="command", required=True)
    w = sub.add_parser("write", help="numpy arrays or an image folder -> shards + index")
    w.add_argument("src", help=".npy / .npz file, or a folder of images")
    w.add_argument("out_dir", help="folder for the shards")
    w.add_argument("--prefix", default="train", help="shard name prefix (default: train)")
    w.add_argument("--per_shard", type=int, default=1000, help="samples per shard (1000)")
    w.add_argument("--key", default=None, help="array name inside a .npz with several")
    i = sub.add_parser("index", help="write index sidecars for existing local shards")
    i.add_argument("spec", help="shard spec: brace pattern, glob, folder")
    i.add_argument("--force", action="store_true", help="rewrite current indexes too")
    i.add_argument("--jobs", type=int, default=1, help="shards walked in parallel (processes)")
    n = sub.add_parser("inspect", help="counts, keys, sizes and bad samples of shards")
    n.add_argument("spec", help="shard spec: brace pattern, glob, folder, pipe:, http(s)://")
    n.add_argument("--json", action="store_true", help="one JSON list of per-shard reports")
    n.add_argument("--input_key", default=None, help="the field a run would train on (--input_key)")
    return p


COMMANDS = {"write": cmd_write, "index": cmd_index, "inspect": cmd_inspect}


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    logging_cfg.configure_console()
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
