"""Checkpoint files on disk: atomic writes, the step/last/best layout, retention, `last` lookup.

Layout of `<output_dir>/checkpoints/`:
- `step-00000100.ckpt`: the training state after that optimizer step, written every
  `--checkpointing_period` steps, at the end of training and on preemption; only the newest
  `--checkpoints_total_limit` are kept.
- `last.ckpt`: the newest step checkpoint (a hard link to it, so pruning the step file leaves it
  intact; a copy where the filesystem has no links). `--resume_from_checkpoint=last` reads it.
- `best.ckpt`: the lowest validation loss so far (`--save_best`).

Every file appears whole or not at all, fsynced with its folder (`ae.atomic_files`): a kill
mid-save leaves the previous file untouched and at most a temporary file, which the next run
removes; a full disk is named as such (`DiskFullError`).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

from loguru import logger

from ae import atomic_files
from ae.errors import DiskFullError
from ae.forensics.resources import FULL_BYTES, Space, disk_full_error, fs_space

LAST = "last.ckpt"
BEST = "best.ckpt"
_STEP_FILE = re.compile(r"^step-(\d+)\.ckpt$")


def atomic_write(path: Path, write: Callable[[BinaryIO], None], what: str = "checkpoint") -> None:
    """`write(f)` into a new version of `path` (`ae.atomic_files.write`, fsynced). A write that
    fails on a full filesystem raises DiskFullError (the temporary file removed, `path` as it
    was); any other failure is raised as it is."""
    spaces: list[Space | None] = []
    try:
        # measured before the clean-up frees the partial file's bytes: a torch.save that fails on
        # a full disk raises a RuntimeError with no errno, and only the free space tells
        atomic_files.write(path, write, on_failure=lambda: spaces.append(fs_space(path.parent)))
    except Exception as e:
        space = spaces[0] if spaces else None
        full = space is not None and space.free < FULL_BYTES
        if full or disk_full_error(e) is not None:
            free, total = (space.free, space.total) if space else (None, None)
            raise DiskFullError(what, str(path), free, total) from e
        raise


def human_size(n: float) -> str:
    if n < 1024:
        return f"{n:.0f} B"
    for unit in ("KB", "MB"):
        n /= 1024
        if n < 1024:
            return f"{n:.1f} {unit}"
    return f"{n / 1024:.2f} GB"


class CheckpointStore:
    """The checkpoint folder of a run. Only global rank 0 writes to it."""

    def __init__(self, directory: Path, keep: int) -> None:
        self.dir = Path(directory)
        self.keep = keep

    @property
    def last(self) -> Path:
        return self.dir / LAST

    @property
    def best(self) -> Path:
        return self.dir / BEST

    def step_path(self, step: int) -> Path:
        return self.dir / f"step-{step:08d}.ckpt"

    def prepare(self) -> None:
        """Create the folder; remove the temporary files that a killed save left behind."""
        self.dir.mkdir(parents=True, exist_ok=True)
        for tmp in atomic_files.leftovers(self.dir):
            logger.warning(f"Removing {tmp}: left by a checkpoint save that did not finish")
            tmp.unlink(missing_ok=True)

    def step_files(self) -> list[Path]:
        """Step checkpoints, oldest first (by write time, then step)."""
        files = [p for p in self.dir.glob("step-*.ckpt") if _STEP_FILE.match(p.name)]

        def order(p: Path) -> tuple[float, int]:
            match = _STEP_FILE.match(p.name)
            assert match is not None
            return p.stat().st_mtime, int(match.group(1))

        return sorted(files, key=order)

    def commit_step(self, path: Path) -> list[Path]:
        """Point `last` at a freshly written step checkpoint and prune old ones; returns the
        removed files."""
        atomic_files.link(path, self.last)
        removed = []
        files = self.step_files()
        for old in files[: max(0, len(files) - self.keep)]:
            if old != path:
                old.unlink(missing_ok=True)
                removed.append(old)
        return removed


def resolve_resume(value: str | None, checkpoints_dir: Path) -> Path | None:
    """`--resume_from_checkpoint`: a path, or `last`. `last` with no checkpoint yet (the first
    run of a job that is requeued with the same command) starts from scratch."""
    if value is None:
        return None
    if value != "last":
        return Path(value)
    last = Path(checkpoints_dir) / LAST
    if last.is_file():
        return last
    logger.warning(f"--resume_from_checkpoint=last: no {last} yet; starting from scratch")
    return None
