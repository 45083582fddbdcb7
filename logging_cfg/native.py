"""Native output of a rank: what C/C++ code writes straight to file descriptors 1 and 2.

NCCL (`NCCL_DEBUG`), gloo and c10d (`TORCH_CPP_LOG_LEVEL`), CUDA and C extensions write to the
process's stdout/stderr descriptors, past loguru. `capture_native_output` points descriptors 1
and 2 at `native_rank<N>_<TS>.log` (O_APPEND, so every write is in the file at once, and forked
dataloader workers inherit it). On the console rank, Python's `sys.stdout` / `sys.stderr` keep
the terminal (rich console lines, progress bar); elsewhere they follow the descriptors into the
file.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import TextIO


def _keep_terminal(stream: TextIO) -> TextIO:
    """A new Python stream on a duplicate of `stream`'s descriptor, before that one is replaced."""
    stream.flush()
    return os.fdopen(
        os.dup(stream.fileno()),
        "w",
        buffering=1,
        encoding=stream.encoding,
        errors="backslashreplace",
    )


def capture_native_output(path: Path, *, keep_console: bool) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    sys.stdout.flush()
    sys.stderr.flush()
    if keep_console:
        sys.stdout = _keep_terminal(sys.stdout)
        sys.stderr = _keep_terminal(sys.stderr)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
