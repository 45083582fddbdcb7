"""Installs a process's logging: `configure` for a training rank (its log files, the console,
the stdlib routing and the crash hooks), `configure_console` for commands that write no run
files."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

from loguru import logger

from logging_cfg.crash import install_exception_hooks, install_faulthandler
from logging_cfg.formats import DEBUG_LOG_FILE, NATIVE_LOG_FILE, RECORD_FORMAT, TRAIN_LOG_FILE
from logging_cfg.hot_path import install as install_debug_lines
from logging_cfg.native import (
    capture_native_output,
    move_native_output,
    native_output_target,
    pending_native_log,
)
from logging_cfg.rank_context import RankContext, rank_tag
from logging_cfg.sinks import AppendFileSink, ConsoleSink
from logging_cfg.stdlib import route_stdlib


@dataclass(frozen=True)
class LogPaths:
    logs_dir: Path
    train_log: Path
    debug_log: Path
    native_log: Path


def _patch_tag(record: dict) -> None:
    record["extra"]["tag"] = rank_tag()


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


def configure_console(
    level: str = "INFO", stream: TextIO | None = None, *, once: bool = False
) -> None:
    """Console-only logging, for commands that write no run files (launcher, diagnose, tools,
    torchrun's agent); `stream`: the console's, where sys.stderr is pointed elsewhere. `once`:
    each distinct line at most once per process (`ae-shards bench` reads the same bad samples
    every epoch, and named each of them hundreds of times)."""
    global _configured
    _configured = True
    install_debug_lines(None)
    logger.remove()
    logger.configure(extra={"tag": ""})
    seen: set[str] = set()

    def first_time(record: dict) -> bool:
        new = record["message"] not in seen
        seen.add(record["message"])
        return new

    logger.add(
        ConsoleSink(stream).write,
        level=level,
        format="{message}",
        colorize=False,
        diagnose=False,
        filter=first_time if once else None,
    )


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
        paths.debug_log, rotate_bytes=rotate, keep=rotate_keep, on_open=install_faulthandler
    )
    # diagnose=False: tracebacks without loguru's variable values. Rendering them calls repr()
    # on every local of every frame, and some are huge: a failed shared-memory allocation has a
    # TypedStorage in its frames, whose repr lists every element (a worker's crash line then took
    # 15-30 s to write, the rank waiting on it); values can also be data that has no place in logs.
    logger.add(
        debug_sink.write, level="DEBUG" if debug else "INFO", format=RECORD_FORMAT, diagnose=False
    )
    install_debug_lines(debug_sink if debug else None)

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
    route_stdlib()
    install_exception_hooks()
    return paths
