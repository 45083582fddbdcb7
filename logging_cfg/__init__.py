"""The one place that configures logging for a training process.

`configure()` installs, for this rank:
- `debug_rank<N>_<TS>.log`: every record of this rank and its dataloader workers;
- `train_<TS>.log` (shared by all ranks): summary lines of rank 0 (records bound with
  `main=True`) and every WARNING/ERROR of any rank;
- a rich console on rank 0 for summary lines and problems;
- stdlib logging (Lightning, torch) and `warnings` routed into the same sinks;
- faulthandler (fatal signals, and `kill -USR1 <pid>` for an on-demand stack dump) on the debug log;
- hooks that log uncaught exceptions (main thread and other threads) as FATAL with traceback.
Library code in `ae/` only uses `loguru.logger`; it never adds sinks.
"""

from __future__ import annotations

import faulthandler
import logging
import os
import signal
import sys
import threading
import warnings
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

from loguru import logger

from ae.log_lines import RECORD_FORMAT
from logging_cfg.rank_context import RankContext, rank_tag, resolve_run_ts
from logging_cfg.sinks import AppendFileSink, ConsoleSink

__all__ = [
    "LogPaths",
    "RankContext",
    "configure",
    "configure_console",
    "is_configured",
    "resolve_run_ts",
]

# loguru appends "\n{exception}" to a string format. Defined beside its reader in ae.log_lines.
LINE_FORMAT = RECORD_FORMAT


@dataclass(frozen=True)
class LogPaths:
    logs_dir: Path
    train_log: Path
    debug_log: Path


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


def _install_exception_hooks() -> None:
    def excepthook(
        exc_type: type[BaseException], exc: BaseException, tb: TracebackType | None
    ) -> None:
        if issubclass(exc_type, KeyboardInterrupt):
            logger.warning("FATAL KeyboardInterrupt: stopped by the user")
            return
        logger.opt(exception=(exc_type, exc, tb)).critical(
            f"FATAL uncaught exception {exc_type.__name__}: {exc}"
        )

    def thread_hook(args: threading.ExceptHookArgs) -> None:
        if args.exc_type is SystemExit:
            return
        name = args.thread.name if args.thread else "?"
        logger.opt(exception=(args.exc_type, args.exc_value, args.exc_traceback)).critical(
            f"FATAL uncaught exception in thread {name} {args.exc_type.__name__}: {args.exc_value}"
        )

    sys.excepthook = excepthook
    threading.excepthook = thread_hook


_fault_file = None  # kept open for the process lifetime: faulthandler writes to its descriptor


def _install_faulthandler(path: Path) -> None:
    global _fault_file
    _fault_file = open(path, "a")  # noqa: SIM115 - must outlive this function
    faulthandler.enable(file=_fault_file, all_threads=True)
    faulthandler.register(signal.SIGUSR1, file=_fault_file, all_threads=True, chain=False)


_configured = False


def is_configured() -> bool:
    return _configured


def configure_console(level: str = "INFO") -> None:
    """Console-only logging, for commands that write no run files (launcher, diagnose, tools)."""
    global _configured
    _configured = True
    logger.remove()
    logger.configure(extra={"tag": ""})
    logger.add(ConsoleSink().write, level=level, format="{message}", colorize=False)


def configure(
    logs_dir: Path,
    run_ts: str,
    ctx: RankContext,
    *,
    debug: bool = False,
    rotate_mb: float = 0,
) -> LogPaths:
    """Install this rank's sinks and hooks. Call once, first thing in a training process."""
    global _configured
    _configured = True
    logs_dir.mkdir(parents=True, exist_ok=True)
    paths = LogPaths(
        logs_dir=logs_dir,
        train_log=logs_dir / f"train_{run_ts}.log",
        debug_log=logs_dir / f"debug_rank{ctx.rank}_{run_ts}.log",
    )
    ctx.install()
    logger.remove()
    logger.configure(patcher=_patch_tag)
    rotate = int(rotate_mb * 2**20)
    debug_sink = AppendFileSink(paths.debug_log, rotate_bytes=rotate)
    logger.add(debug_sink.write, level="DEBUG" if debug else "INFO", format=LINE_FORMAT)

    def train_filter(record: dict) -> bool:
        return record["level"].no >= logging.WARNING or (
            ctx.rank == 0 and record["extra"].get("main", False)
        )

    logger.add(AppendFileSink(paths.train_log).write, filter=train_filter, format=LINE_FORMAT)
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
            return level >= logging.ERROR or (record["name"] or "").startswith("ae")

        logger.add(ConsoleSink().write, filter=console_filter, format="{message}", colorize=False)
    _route_stdlib()
    _install_exception_hooks()
    _install_faulthandler(paths.debug_log)
    return paths
