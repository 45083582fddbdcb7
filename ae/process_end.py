"""How ae's processes end: with their parent, and without the interpreter's teardown.

**With their parent**: the kernel's parent-death signal (Linux `prctl(PR_SET_PDEATHSIG)`), however
the parent dies. Used by torchrun's wrapper (SIGTERM when the launcher dies: the ranks then save
and stop) and by dataloader workers (SIGKILL when their rank dies: a worker ignores SIGTERM, and
one blocked in a read would otherwise outlive a killed rank).

**Without the teardown**: when Python exits it joins the threads that are not daemons, runs the
`atexit` handlers, then tears down every module and object it holds, and the C++ libraries run
their static destructors. For a process that imported torch and Lightning the teardown alone
costs ~1.2 s of CPU (measured on 2 cores: `import lightning.pytorch` then a normal exit, 6.2 s of
CPU; then `exit_without_teardown`, 4.9 s), which a rank spends after its last line is written,
with nothing left to do; it is also where a native library can hang at exit.
`exit_without_teardown` keeps everything Python's exit promises but the teardown: other threads
joined, `atexit` handlers run (loguru's sinks closed, multiprocessing's dataloader workers
ended, a W&B run finished), the standard streams flushed; then `os._exit`. `run_then_exit` ends
the rank processes (training and ae-encode) and torchrun's wrapper that way, whether their main
returns or raises (the exception reported by `sys.excepthook` as Python would: logging_cfg's
FATAL record).
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import os
import signal
import sys
import threading
from collections.abc import Callable
from typing import NoReturn

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def die_with_parent(signum: signal.Signals, parent_pid: int) -> None:
    """`signum` to this process when the thread that started it ends (in ae: the parent's main
    thread, which lives as long as the parent). A parent gone before the request (its death sent
    nothing): `signum` now."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, signum, 0, 0, 0) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"prctl(PR_SET_PDEATHSIG): {os.strerror(errno)}")
    if os.getppid() != parent_pid:
        os.kill(os.getpid(), signum)


def exit_without_teardown(code: int) -> NoReturn:
    """Exit with `code` as `sys.exit(code)` would, skipping only the interpreter's teardown."""
    try:
        for thread in threading.enumerate():
            if thread is not threading.current_thread() and not thread.daemon:
                thread.join()
        # CPython's own step of exiting (Py_FinalizeEx runs it); no public name calls it early.
        atexit._run_exitfuncs()
    finally:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(OSError, ValueError, AttributeError):  # closed, or None
                stream.flush()
        os._exit(code)


def run_then_exit(main: Callable[[list[str]], int], argv: list[str]) -> NoReturn:
    """`sys.exit(main(argv))` without the teardown. An exception out of `main` is reported by
    `sys.excepthook` and exits 1, as Python does; SystemExit and KeyboardInterrupt keep Python's
    own ways out (their codes, and the SIGINT exit status)."""
    try:
        code = main(argv)
    except (SystemExit, KeyboardInterrupt):
        raise
    except BaseException:
        sys.excepthook(*sys.exc_info())
        code = 1
    exit_without_teardown(code)
