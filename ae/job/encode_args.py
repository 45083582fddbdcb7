"""ae-encode's arguments, parsed the same in the launcher (`ae.job.encode`) and in every rank
(`ae.rank.encode`), and the output shard names. Light: a rank imports it, never the launcher's
job module (which reads the logs' verdicts: `ae.diagnose`).
"""

from __future__ import annotations

import argparse
import re
from dataclasses import dataclass
from pathlib import Path
from typing import NoReturn

from ae.data.shards.spec import is_remote, split_by_shell
from ae.errors import UserError
from ae.job.folder_lock import TRAINING, read_lock
from ae.run_paths import RunDir, checkpoints_in_folder

_TAR_NAME = re.compile(r"([^/\s'\"?]+\.tar)\b")


class EncodeArgsError(UserError):
    """Bad arguments to ae-encode: every problem, one line each."""


@dataclass(frozen=True)
class EncodeArgs:
    ckpt: str
    spec: str
    out_dir: str
    batch_size: int = 64
    field: str = "latent.npy"
    dtype: str = "float32"
    keep_fields: str = ""
    devices: str = "auto"
    accelerator: str = "auto"
    num_workers: int = 1
    tar_reader: str = "fast"
    debug: bool = False
    stall_timeout: float = 300.0
    pg_timeout: float = 600.0
    trust_checkpoint: bool = False
    overwrite: bool = False

    @property
    def keep(self) -> frozenset[str]:
        return frozenset(f.strip() for f in self.keep_fields.split(",") if f.strip())

    @property
    def logs(self) -> Path:
        return Path(self.out_dir) / "logs"


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        raise EncodeArgsError(f"{message} (see ae-encode --help)")


def _parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="ae-encode",
        description="`ae-encode CKPT SPEC OUT_DIR`: encode every sample of a shard set with a "
        "trained checkpoint.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("ckpt", help="checkpoint of an ae run (e.g. runs/ae/checkpoints/last.ckpt)")
    p.add_argument("spec", help="shards to encode: brace pattern, glob, folder, pipe:, http(s)://")
    p.add_argument("out_dir", help="folder for the output shards (and logs/)")
    p.add_argument("--batch_size", type=int, default=64, help="samples per batch (64)")
    p.add_argument("--field", default="latent.npy", help="output field of the latent (latent.npy)")
    p.add_argument(
        "--dtype",
        choices=("float32", "float16"),
        default="float32",
        help="dtype of the stored latent (float32); float16 halves the output",
    )
    p.add_argument(
        "--keep_fields", default="", help="input fields to copy, comma-separated, or all"
    )
    p.add_argument("--devices", default="auto", help="processes per node: N, or auto")
    p.add_argument(
        "--accelerator",
        choices=("auto", "cpu", "gpu"),
        default="auto",
        help="auto picks gpu when one is visible (auto)",
    )
    p.add_argument("--num_workers", type=int, default=1, help="reader processes per rank (1)")
    p.add_argument(
        "--tar_reader",
        choices=("fast", "tarfile"),
        default="fast",
        help="tar parsing: fast (header cutting) or tarfile (Python's module) (fast)",
    )
    p.add_argument("--debug", action="store_true", help="per-batch lines in the rank logs")
    p.add_argument("--stall_timeout", type=float, default=300.0, help="watchdog, s (0 = off)")
    p.add_argument("--pg_timeout", type=float, default=600.0, help="collective timeout, s")
    p.add_argument(
        "--trust_checkpoint",
        action="store_true",
        help="load a checkpoint the safe loader refuses; runs code from the file: only for "
        "files you made",
    )
    p.add_argument(
        "--overwrite",
        action="store_true",
        help="encode every output again, replacing those OUT_DIR already holds; without it, a "
        "run of the same command skips the complete outputs of an earlier one and refuses "
        "other files of an output's name",
    )
    return p


def parse_args(argv: list[str]) -> EncodeArgs:
    """Parse and check everything but the shards; every problem in one EncodeArgsError."""
    parsed, extra = _parser().parse_known_args(argv)
    if extra:
        hint = split_by_shell([parsed.spec, parsed.out_dir, *extra])
        unknown = f"unrecognized arguments: {' '.join(extra)} (see ae-encode --help)"
        raise EncodeArgsError(hint or unknown)
    args = EncodeArgs(**vars(parsed))
    problems = []
    if Path(args.ckpt).is_dir():
        problems.append(_ckpt_folder_problem(Path(args.ckpt)))
    elif not Path(args.ckpt).is_file():
        problems.append(f"CKPT: no such checkpoint file: {args.ckpt}")
    if args.batch_size < 1:
        problems.append(f"batch_size: must be >= 1; got {args.batch_size}")
    if args.num_workers < 0:
        problems.append(f"num_workers: must be >= 0; got {args.num_workers}")
    if not re.fullmatch(r"[A-Za-z0-9_-]+(\.[A-Za-z0-9_-]+)*\.npy", args.field):
        problems.append(f"field: must be a field name ending in .npy; got {args.field!r}")
    if args.field in args.keep:
        problems.append(f"keep_fields: names the output field {args.field}")
    if args.devices != "auto" and not (args.devices.isdigit() and int(args.devices) >= 1):
        problems.append(f"devices: must be a positive integer or auto; got {args.devices!r}")
    run = RunDir(Path(args.out_dir))
    holder = read_lock(run.lock)
    if run.checkpoints.is_dir() or run.config_yaml.exists() or (holder and holder.kind == TRAINING):
        # Its logs would sit among the run's (ae-diagnose would read the encoding as its newest
        # run), its shards beside the checkpoints.
        problems.append(f"OUT_DIR: {args.out_dir} holds a training run; encode into another folder")
    if problems:
        raise EncodeArgsError("\n".join(problems))
    return args


def _ckpt_folder_problem(folder: Path) -> str:
    """A run folder or its checkpoints/ given as CKPT: name the files to pick from."""
    return f"CKPT: {folder} is a folder{checkpoints_in_folder(folder)}"


def output_paths(urls: list[str], out_dir: Path) -> list[Path]:
    """Each input shard's output: its file name in `out_dir` (for `pipe:` commands, the word
    ending in `.tar`; without one, `shard-<i>.tar`)."""
    names = []
    for i, url in enumerate(urls):
        found = _TAR_NAME.findall(url) if is_remote(url) else [Path(url).name]
        names.append(found[-1] if found else f"shard-{i:06d}.tar")
    return [out_dir / name for name in names]


def help_text() -> str:
    return _parser().format_help()
