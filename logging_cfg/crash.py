"""Crash hooks: uncaught exceptions (main thread, other threads, dataloader workers) logged as
FATAL with their traceback, and faulthandler on the debug log (fatal signals, `kill -USR1`, and
the native timer the watchdog re-arms)."""

from __future__ import annotations

import faulthandler
import functools
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from types import TracebackType
from typing import Any

from loguru import logger

from logging_cfg.formats import FATAL, WORKER_ORPHANED
from logging_cfg.rank_context import worker_info

_rank_pid: int | None = None  # the rank process; its forked dataloader workers inherit it
_orphan_said = False


def parent_gone() -> bool:
    """In a dataloader worker forked from the rank: the rank process is gone (the worker was
    reparented)."""
    return _rank_pid is not None and os.getpid() != _rank_pid and os.getppid() != _rank_pid


def _orphaned() -> bool:
    """A worker left by its dead rank: says so once (never a FATAL line: the exception, a socket
    to the rank reset, is only the rank's death seen from here)."""
    global _orphan_said
    if not parent_gone():
        return False
    if not _orphan_said:
        _orphan_said = True
        logger.info(WORKER_ORPHANED.format())
    return True


def _fatal(exc_type: type[BaseException], exc: BaseException, where: str) -> str:
    return FATAL.format(exc_type=exc_type.__name__, where=where, message=exc)


def install_exception_hooks() -> None:
    """Uncaught exceptions of the main thread and of other threads logged as FATAL (CRITICAL)
    with their traceback; Ctrl-C as a WARNING. In a dataloader worker whose rank is gone, one
    INFO line instead."""
    global _rank_pid
    _rank_pid = os.getpid()

    def excepthook(
        exc_type: type[BaseException], exc: BaseException, tb: TracebackType | None
    ) -> None:
        if _orphaned():
            return
        if issubclass(exc_type, KeyboardInterrupt):
            where, message = "main thread", "stopped by the user"
            logger.warning(FATAL.format(exc_type=exc_type.__name__, where=where, message=message))
            return
        logger.opt(exception=(exc_type, exc, tb)).critical(_fatal(exc_type, exc, "main thread"))

    def thread_hook(args: threading.ExceptHookArgs) -> None:
        if args.exc_type is SystemExit or _orphaned():
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
            if _orphaned():
                raise SystemExit(0) from None  # out of torch's worker loop, quietly
            if (w := worker_info()) is not None:
                where = f"dataloader worker {w[0]}/{w[1]}"
                logger.opt(exception=True).critical(_fatal(type(e), e, where))
            raise

    return wrapper


# faulthandler writes to the debug log's descriptor: fatal signals (SIGSEGV, SIGABRT, SIGBUS,
# SIGFPE, SIGILL), `kill -USR1 <pid>`, and dump_stacks_later(). It needs no interpreter lock.
_fault_fd: int | None = None


def install_faulthandler(fd: int) -> None:
    """On `fd`, the debug log's descriptor (it is (re)opened there, rotations included)."""
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
