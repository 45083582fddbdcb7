"""Log sinks with the durability the product contract (docs/CONTRACT.md) promises.

`AppendFileSink` writes each record with one `os.write` on an `O_APPEND` descriptor: the line is in
the kernel before the logging call returns (it survives SIGKILL of the process), and records from
different processes (ranks, forked dataloader workers) never interleave because each is a single
append. Nothing is buffered in user space and no background thread owns the writes.
"""

from __future__ import annotations

import fcntl
import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any, TextIO

from rich.console import Console
from rich.text import Text


class AppendFileSink:
    """A loguru sink: one O_APPEND write per record, optional size-based rotation.

    Rotation: when the file would exceed `rotate_bytes`, `x.log` becomes `x.log.1` (`.1` ->
    `.2` ..., at most `keep` rotated files); processes appending at the same moment may each
    overshoot by a record. `on_open(fd)` is called with each new descriptor before the old one
    is closed (faulthandler follows the debug log that way).
    """

    def __init__(
        self,
        path: Path,
        rotate_bytes: int = 0,
        keep: int = 3,
        on_open: Callable[[int], None] | None = None,
    ) -> None:
        self.path = Path(path)
        self.rotate_bytes = rotate_bytes
        self.keep = keep
        self.on_open = on_open
        self._lock = threading.Lock()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.fd = self._open()

    def _open(self) -> int:
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        if self.on_open is not None:
            self.on_open(fd)
        return fd

    def _rotate(self) -> None:
        # Several processes append to one file (a rank and its forked workers; every rank for
        # the train log). Under an exclusive lock on the full file, the first one renames it;
        # the others then find that the path names a newer file, and only reopen it. A POSIX
        # record lock (lockf) belongs to the process: flock's would be shared by a forked worker
        # that inherited the descriptor.
        old = self.fd
        fcntl.lockf(old, fcntl.LOCK_EX)
        try:
            try:
                current = os.stat(self.path).st_ino
            except FileNotFoundError:
                current = None
            if current == os.fstat(old).st_ino:
                for i in range(self.keep - 1, 0, -1):
                    src = self.path.with_name(f"{self.path.name}.{i}")
                    if src.exists():
                        src.replace(self.path.with_name(f"{self.path.name}.{i + 1}"))
                self.path.replace(self.path.with_name(f"{self.path.name}.1"))
        finally:
            fcntl.lockf(old, fcntl.LOCK_UN)
        self.fd = self._open()
        os.close(old)

    def write(self, message: str) -> None:
        data = message.encode("utf-8", "replace")
        with self._lock:
            if self.rotate_bytes and os.fstat(self.fd).st_size + len(data) > self.rotate_bytes:
                self._rotate()
            written = os.write(self.fd, data)
            while written < len(data):  # a regular file takes it all at once; not on a full disk
                written += os.write(self.fd, data[written:])

    # Picklable for spawn-started dataloader workers: reopen the same file on the other side.
    def __getstate__(self) -> dict[str, Any]:
        return {
            "path": self.path,
            "rotate_bytes": self.rotate_bytes,
            "keep": self.keep,
            "on_open": self.on_open,
        }

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(**state)


_LEVEL_STYLE = {
    "WARNING": "yellow",
    "ERROR": "bold red",
    "CRITICAL": "bold red",
    "SUCCESS": "green",
}


class ConsoleSink:
    """Short, calm console lines on rank 0 through rich: `12:00:01 message`."""

    def __init__(self, stream: TextIO | None = None) -> None:
        # `stream`: a fixed one (torchrun's agent points sys.stderr at its log file); else
        # whatever sys.stderr is at each line.
        self.console = _Console(file=stream, stderr=True, highlight=False, soft_wrap=True)

    def write(self, message: Any) -> None:
        record = message.record
        style = _LEVEL_STYLE.get(record["level"].name, "")
        line = Text(record["time"].strftime("%H:%M:%S "), style="dim")
        line.append(record["message"], style=style)
        self.console.print(line)


class _Console(Console):
    """rich's Console, except when the console's pipe is closed (`./train_ae.sh | head`, a `tee`
    that was stopped): rich's own answer is SystemExit(1), which ended the launcher or rank 0 in
    the middle of training. Here the run goes on, its lines in the log files."""

    def on_broken_pipe(self) -> None:
        self.quiet = True  # rich drops every later line
        # The stream's descriptor to /dev/null: what its buffer holds, flushed at exit, goes
        # nowhere (a failed flush there would end the process with code 120)
        devnull = os.open(os.devnull, os.O_WRONLY)
        try:
            os.dup2(devnull, self.file.fileno())
        finally:
            os.close(devnull)
