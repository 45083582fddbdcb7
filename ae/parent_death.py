"""A child process that dies with its parent, however the parent dies: the kernel's parent-death
signal (Linux `prctl(PR_SET_PDEATHSIG)`). Used by torchrun's wrapper (SIGTERM when the launcher
dies: the ranks then save and stop) and by dataloader workers (SIGKILL when their rank dies: a
worker ignores SIGTERM, and one blocked in a read would otherwise outlive a killed rank)."""

from __future__ import annotations

import ctypes
import os
import signal

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
