"""Native output of a rank: what C/C++ code writes straight to file descriptors 1 and 2.

NCCL (`NCCL_DEBUG`), gloo and c10d (`TORCH_CPP_LOG_LEVEL`), CUDA and C extensions write to the
process's stdout/stderr descriptors, past loguru. `capture_native_output` points descriptors 1
and 2 at `native_rank<N>_<TS>.log` (O_APPEND, so every write is in the file at once, and forked
dataloader workers inherit it). On the console rank, Python's `sys.stdout` / `sys.stderr` keep
the terminal (rich console lines, progress bar); elsewhere they follow the descriptors into the
file.

A rank started by the launcher captures from its first line, before torch is imported (c10d
writes from import time on, and in the run-timestamp handshake). When the run's timestamp is not
known yet (ranks started by hand on several nodes agree on it later), the capture starts in a
hidden `.native_rank<N>.<pid>.pending` file, which `move_native_output` then renames.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import TextIO

_target: Path | None = None  # the file descriptors 1 and 2 point at, once captured


def _keep_terminal(stream: TextIO) -> TextIO:
    """A new Python stream on a duplicate of `stream`'s descriptor, before that one is replaced.
    It lives as long as the process and is never closed: `closefd=False`, or its deallocation
    at interpreter exit would warn (`ResourceWarning: unclosed file`) into the native log."""
    stream.flush()
    return os.fdopen(
        os.dup(stream.fileno()),
        "w",
        buffering=1,
        encoding=stream.encoding,
        errors="backslashreplace",
        closefd=False,
    )


def _point_descriptors_at(path: Path) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)


def capture_native_output(path: Path, *, keep_console: bool) -> None:
    global _target
    sys.stdout.flush()
    sys.stderr.flush()
    if keep_console:
        sys.stdout = _keep_terminal(sys.stdout)
        sys.stderr = _keep_terminal(sys.stderr)
    _point_descriptors_at(path)
    _target = path


def streams_to_native_in_child() -> None:
    """In a process forked from the console rank (a dataloader worker): its `sys.stdout` /
    `sys.stderr` still write to the terminal, so a worker's Python-level output (the traceback
    that multiprocessing's queue thread prints when a batch cannot be put in shared memory) would
    land on the console. Point them at descriptors 1 and 2, the rank's native log."""
    if _target is None or sys.stderr.fileno() == 2:
        return
    sys.stdout.flush()
    sys.stderr.flush()
    sys.stdout = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115 - the process's stream
    sys.stderr = open(2, "w", buffering=1, closefd=False, errors="backslashreplace")  # noqa: SIM115


def native_output_target() -> Path | None:
    """The file native output goes to, or None before `capture_native_output`."""
    return _target


def pending_native_log(logs_dir: Path, rank: int) -> Path:
    """Where a rank captures before its run's timestamp is known (no `*_<TS>.log` name: a rank
    that dies in the handshake leaves no file that looks like a run's)."""
    return logs_dir / f".native_rank{rank}.{os.getpid()}.pending"


def move_native_output(path: Path) -> None:
    """Continue the capture in `path` (the run's file name): the early file is renamed (the
    descriptors follow it), or appended to `path` when that exists already."""
    global _target
    if _target is None or _target == path:
        return
    if not path.exists():
        os.replace(_target, path)
    else:
        with open(_target, "rb") as early, open(path, "ab") as out:
            out.write(early.read())
        _point_descriptors_at(path)
        _target.unlink(missing_ok=True)
    _target = path
