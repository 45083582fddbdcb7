"""The one place that configures logging for a training process.

`configure()` installs, for this rank:
- `debug_rank<N>_<TS>.log`: every record of this rank and its dataloader workers;
- `native_rank<N>_<TS>.log` (with `native_output=True`): what native code writes to stdout/stderr;
- `train_<TS>.log` (shared by all ranks): summary lines of rank 0 (records bound with
  `main=True`) and every WARNING/ERROR of any rank;
- a rich console on rank 0 for summary lines and problems;
- stdlib logging (Lightning, torch) and `warnings` routed into the same sinks;
- faulthandler (fatal signals, and `kill -USR1 <pid>` for an on-demand stack dump) on the debug log;
- hooks that log uncaught exceptions (main thread and other threads) as FATAL with traceback;
  `log_worker_exceptions` does the same inside dataloader workers;
- `debug_line`: the per-batch DEBUG lines, straight into the debug log (see hot_path).
Library code in `ae/` only uses `loguru.logger`; it never adds sinks.
"""

from __future__ import annotations

import faulthandler
import functools
import logging
import os
import signal
import sys
import threading
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

from loguru import logger

from logging_cfg import hot_path
from logging_cfg.formats import (
    DEBUG_LOG_FILE,
    FATAL,
    NATIVE_LOG_FILE,
    RECORD_FORMAT,
    TRAIN_LOG_FILE,
)
from logging_cfg.hot_path import debug_line
from logging_cfg.native import (
    capture_native_output,
    move_native_output,
    native_output_target,
    pending_native_log,
    streams_to_native_in_child,
)
from logging_cfg.rank_context import RankContext, rank_tag, resolve_run_ts, worker_info
from logging_cfg.sinks import AppendFileSink, ConsoleSink

__all__ = [
    "LogPaths",
    "RankContext",
    "cancel_dump_stacks_later",
    "configure",
    "configure_console",
    "debug_line",
    "dump_stacks_later",
    "is_configured",
    "log_worker_exceptions",
    "resolve_run_ts",
    "start_native_capture",
    "streams_to_native_in_child",
]


@dataclass(frozen=True)
class LogPaths:
    logs_dir: Path
    train_log: Path
    debug_log: Path
    native_log: Path


FORK_WITH_THREADS_WARNING = r"This process \(pid=\d+\) is multi-threaded, use of fork\(\)"


class _InterceptHandler(logging.Handler):
    """Send stdlib records (Lightning, torch, py.warnings) to loguru, keeping level and caller."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            level: str | int = logger.level(record.levelname).name
        except ValueError:
            level = record.levelno
        frame, depth = logging.currentframe(), 2
        while frame and frame.f_code.co_filename == logging.__file__:
            frame, depth = frame.f_back, depth + 1
        logger.opt(depth=depth, exception=record.exc_info).log(level, record.getMessage())


def _patch_tag(record: dict) -> None:
    record["extra"]["tag"] = rank_tag()


def _route_stdlib() -> None:
    logging.root.handlers = [_InterceptHandler()]
    logging.root.setLevel(logging.INFO)
    for name in (
        "lightning",
        "lightning.pytorch",
        "lightning.fabric",
        "pytorch_lightning",
        "torch",
    ):
        lg = logging.getLogger(name)
        lg.handlers.clear()
        lg.propagate = True
    logging.captureWarnings(True)
    warnings.simplefilter("default")
    # Python >= 3.12 warns from inside os.fork() when other threads run (the watchdog does, and
    # every DataLoader forks its workers). It warns in the parent before the at-fork "after"
    # hooks run, while loguru's own at-fork hook still holds every handler's lock: routed to
    # loguru, that warning deadlocks the rank at its first batch (seen on a GPU node).
    warnings.filterwarnings(
        "ignore", message=FORK_WITH_THREADS_WARNING, category=DeprecationWarning
    )


def _fatal(exc_type: type[BaseException], exc: BaseException, where: str) -> str:
    return FATAL.format(exc_type=exc_type.__name__, where=where, message=exc)


def _install_exception_hooks() -> None:
    def excepthook(
        exc_type: type[BaseException], exc: BaseException, tb: TracebackType | None
    ) -> None:
        if issubclass(exc_type, KeyboardInterrupt):
            where, message = "main thread", "stopped by the user"
            logger.warning(FATAL.format(exc_type=exc_type.__name__, where=where, message=message))
            return
        logger.opt(exception=(exc_type, exc, tb)).critical(_fatal(exc_type, exc, "main thread"))

    def thread_hook(args: threading.ExceptHookArgs) -> None:
        if args.exc_type is SystemExit:
            return
        where = f"thread {args.thread.name if args.thread else '?'}"
        logger.opt(exception=(args.exc_type, args.exc_value, args.exc_traceback)).critical(
            _fatal(args.exc_type, args.exc_value or args.exc_type(), where)
        )

    sys.excepthook = excepthook
    threading.excepthook = thread_hook


def log_worker_exceptions(iter_fn: Callable[..., Iterator[Any]]) -> Callable[..., Iterator[Any]]:
    """Decorates a dataset's `__iter__`. In a dataloader worker, torch catches the exception and
    raises it again in the rank with the worker's traceback flattened into the message; log it
    here first, from the worker, as FATAL with its real traceback (then let torch do its part)."""

    @functools.wraps(iter_fn)
    def wrapper(*args: Any, **kwargs: Any) -> Iterator[Any]:
        try:
            yield from iter_fn(*args, **kwargs)
        except Exception as e:
            if (w := worker_info()) is not None:
                where = f"dataloader worker {w[0]}/{w[1]}"
                logger.opt(exception=True).critical(_fatal(type(e), e, where))
            raise

    return wrapper


# faulthandler writes to the debug log's descriptor: fatal signals (SIGSEGV, SIGABRT, SIGBUS,
# SIGFPE, SIGILL), `kill -USR1 <pid>`, and dump_stacks_later(). It needs no interpreter lock.
_fault_fd: int | None = None


def _install_faulthandler(fd: int) -> None:
    global _fault_fd
    _fault_fd = fd
    faulthandler.enable(file=fd, all_threads=True)
    faulthandler.register(signal.SIGUSR1, file=fd, all_threads=True, chain=False)


def dump_stacks_later(seconds: float) -> None:
    """(Re)arm a native timer that dumps all stacks into the debug log after `seconds`. The
    watchdog re-arms it on every check: it fires only when the watchdog thread itself cannot
    run (native code holding the interpreter lock), the one stall the watchdog cannot report."""
    if _fault_fd is not None:
        faulthandler.dump_traceback_later(seconds, repeat=False, file=_fault_fd)


def cancel_dump_stacks_later() -> None:
    faulthandler.cancel_dump_traceback_later()


def start_native_capture(logs_dir: Path, ctx: RankContext, run_ts: str | None) -> Path:
    """Send this process's native output (descriptors 1 and 2) to its rank's native log now,
    before torch is imported; `configure(native_output=True)` carries on with it. Without the
    run's timestamp yet, into a pending file that `configure` renames."""
    logs_dir.mkdir(parents=True, exist_ok=True)
    if run_ts:
        path = logs_dir / NATIVE_LOG_FILE.format(rank=ctx.rank, ts=run_ts)
    else:
        path = pending_native_log(logs_dir, ctx.rank)
    capture_native_output(path, keep_console=ctx.rank == 0)
    return path


_configured = False


def is_configured() -> bool:
    return _configured


def configure_console(level: str = "INFO") -> None:
    """Console-only logging, for commands that write no run files (launcher, diagnose, tools)."""
    global _configured
    _configured = True
    hot_path.install(None)
    logger.remove()
    logger.configure(extra={"tag": ""})
    logger.add(ConsoleSink().write, level=level, format="{message}", colorize=False, diagnose=False)


def configure(
    logs_dir: Path,
    run_ts: str,
    ctx: RankContext,
    *,
    debug: bool = False,
    rotate_mb: float = 0,
    rotate_keep: int = 3,
    native_output: bool = False,
    fatal_on_console: bool = True,
) -> LogPaths:
    """Install this rank's sinks and hooks. Call once, first thing in a training process.

    `rotate_mb` > 0 rotates the debug and train logs at that size, keeping `rotate_keep` old
    files. `native_output` sends this process's descriptors 1 and 2 to `native_rank<N>_<TS>.log`
    (the rank launched by torchrun; not a test process sharing its descriptors). Without
    `fatal_on_console`, uncaught exceptions (FATAL, CRITICAL) stay off rank 0's console: the
    launcher prints the diagnosis of the whole job after it, in which rank 0's error may be only
    a peer's failure."""
    global _configured
    _configured = True
    logs_dir.mkdir(parents=True, exist_ok=True)
    paths = LogPaths(
        logs_dir=logs_dir,
        train_log=logs_dir / TRAIN_LOG_FILE.format(ts=run_ts),
        debug_log=logs_dir / DEBUG_LOG_FILE.format(rank=ctx.rank, ts=run_ts),
        native_log=logs_dir / NATIVE_LOG_FILE.format(rank=ctx.rank, ts=run_ts),
    )
    if native_output:
        if native_output_target() is None:
            capture_native_output(paths.native_log, keep_console=ctx.rank == 0)
        else:  # captured from the process's first line (start_native_capture): keep it
            move_native_output(paths.native_log)
    ctx.install()
    logger.remove()
    logger.configure(patcher=_patch_tag)
    rotate = int(rotate_mb * 2**20)
    debug_sink = AppendFileSink(
        paths.debug_log, rotate_bytes=rotate, keep=rotate_keep, on_open=_install_faulthandler
    )
    # diagnose=False: tracebacks without loguru's variable values. Rendering them calls repr()
    # on every local of every frame, and some are huge: a failed shared-memory allocation has a
    # TypedStorage in its frames, whose repr lists every element (a worker's crash line then took
    # 15-30 s to write, the rank waiting on it); values can also be data that has no place in logs.
    logger.add(
        debug_sink.write, level="DEBUG" if debug else "INFO", format=RECORD_FORMAT, diagnose=False
    )
    hot_path.install(debug_sink if debug else None)

    def train_filter(record: dict) -> bool:
        return record["level"].no >= logging.WARNING or (
            ctx.rank == 0 and record["extra"].get("main", False)
        )

    train_sink = AppendFileSink(paths.train_log, rotate_bytes=rotate, keep=rotate_keep)
    logger.add(train_sink.write, filter=train_filter, format=RECORD_FORMAT, diagnose=False)
    if ctx.rank == 0:
        rank_pid = os.getpid()

        def console_filter(record: dict) -> bool:
            # Summary lines, our own warnings and any error of the rank process itself; library
            # chatter, worker lines and details stay in the files.
            extra, level = record["extra"], record["level"].no
            if extra.get("main", False):
                return extra.get("console", True)
            if record["process"].id != rank_pid or level < logging.WARNING:
                return False
            if level >= logging.CRITICAL and not fatal_on_console:
                return False
            return level >= logging.ERROR or (record["name"] or "").startswith("ae")

        logger.add(
            ConsoleSink().write, filter=console_filter, format="{message}", colorize=False,
            diagnose=False,
        )  # fmt: skip
    _route_stdlib()
    _install_exception_hooks()
    return paths
