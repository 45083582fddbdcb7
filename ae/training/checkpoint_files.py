"""Checkpoint files on disk: the step/last/best layout, retention, `last` lookup.

Layout of `<output_dir>/checkpoints/`:
- `step-00000100.ckpt`: the training state after that optimizer step, written every
  `--checkpointing_period` steps, at the end of training and on preemption; only the newest
  `--checkpoints_total_limit` are kept.
- `last.ckpt`: the newest step checkpoint (a hard link to it, so pruning the step file leaves it
  intact; a copy where the filesystem has no links). `--resume_from_checkpoint=last` reads it
  (`ae.training.position.resume_source`).
- `best.ckpt`: the lowest validation loss so far (`--save_best`).

Every file appears whole or not at all, fsynced with its folder (`ae.atomic_files`): a kill
mid-save leaves the previous file untouched and at most a temporary file, which the next run
removes; a full disk is named as such (`DiskFullError`).
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from loguru import logger

from ae import atomic_files

LAST = "last.ckpt"
BEST = "best.ckpt"
_STEP_FILE = re.compile(r"^step-(\d+)\.ckpt$")


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

    def step_files(self, before: int | None = None) -> list[Path]:
        """Step checkpoints, oldest first (by write time, then step); with `before`, only those
        of earlier steps."""
        steps = {p: int(m.group(1)) for p in self.dir.glob("step-*.ckpt")
                 if (m := _STEP_FILE.match(p.name))}  # fmt: skip
        if before is not None:
            steps = {p: step for p, step in steps.items() if step < before}
        return sorted(steps, key=lambda p: (p.stat().st_mtime, steps[p]))

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

    def resumed_from(self, path: Path) -> str | None:
        """A run resumed from an older checkpoint of this folder than the one `last.ckpt` names
        (going back before a divergence) goes on from it: `last.ckpt` names it from now on, so
        that a restart, a requeue or a later `--resume_from_checkpoint=last` continues this
        run, not the steps it went back from. The line that says so; None when `last.ckpt`
        named it already, or it is of another folder."""
        path = Path(path)
        if path.name == LAST or path.resolve().parent != self.dir.resolve():
            return None
        if not self.last.is_file():
            atomic_files.link(path, self.last)
            return None
        if os.path.samefile(path, self.last):
            return None
        named = next((p.name for p in self.step_files() if os.path.samefile(p, self.last)), LAST)
        atomic_files.link(path, self.last)
        return (
            f"{LAST} now names {path.name}, the checkpoint this run resumed (it named {named}): "
            f"a restart or --resume_from_checkpoint=last continues from here, not from the "
            f"steps it went back from"
        )
