"""Memory and process figures of a rank and its dataloader workers (psutil), and of its GPU.

`memory_summary()` goes on every debug `Training step` line, so it must stay cheap: reading one
RSS is ~10 us, but listing children scans all of /proc (milliseconds on a busy node), so the
list of children is refreshed at most every `CHILDREN_REFRESH_S`. `process_table()` is for stall
reports: state, RSS, CPU, open fds and threads of the rank and each child.
"""

from __future__ import annotations

import os
import time

import psutil
import torch

_MB = 2**20
CHILDREN_REFRESH_S = 2.0


def process_rss_mb(proc: psutil.Process | None = None) -> float:
    return (proc or psutil.Process()).memory_info().rss / _MB


def children_rss_mb() -> dict[int, float]:
    """pid -> RSS in MB of each child process (dataloader workers); vanished ones are skipped."""
    out = {}
    for child in psutil.Process().children(recursive=True):
        try:
            out[child.pid] = child.memory_info().rss / _MB
        except psutil.Error:
            continue
    return out


class _ChildrenCache:
    """psutil handles of this process's children, re-listed at most every CHILDREN_REFRESH_S."""

    def __init__(self) -> None:
        self.pid = -1
        self.listed_at = 0.0
        self.me: psutil.Process | None = None
        self.children: list[psutil.Process] = []

    def get(self) -> tuple[psutil.Process, list[psutil.Process]]:
        now = time.monotonic()
        if self.pid != os.getpid():  # first use, or a forked child using the module
            self.pid, self.me, self.listed_at = os.getpid(), psutil.Process(), -CHILDREN_REFRESH_S
        assert self.me is not None
        if now - self.listed_at >= CHILDREN_REFRESH_S:
            self.children = self.me.children(recursive=True)
            self.listed_at = now
        return self.me, self.children


_cache = _ChildrenCache()


def cuda_summary(device: int | None = None) -> str:
    """`cuda=1.20/3.40GB peak=2.00GB` (allocated/reserved, peak allocated), or "" without CUDA.
    Reads the caching allocator's counters only (no driver call that could block on a hung GPU)."""
    if not (torch.cuda.is_available() and torch.cuda.is_initialized()):
        return ""
    alloc = torch.cuda.memory_allocated(device) / 2**30
    reserved = torch.cuda.memory_reserved(device) / 2**30
    peak = torch.cuda.max_memory_allocated(device) / 2**30
    return f"cuda={alloc:.2f}/{reserved:.2f}GB peak={peak:.2f}GB"


def memory_summary() -> str:
    """`rss=812MB workers=3x120MB` (largest worker) plus the CUDA figures on GPU."""
    me, children = _cache.get()
    workers = []
    for child in children:
        try:
            workers.append(child.memory_info().rss / _MB)
        except psutil.Error:
            continue
    text = f"rss={process_rss_mb(me):.0f}MB"
    if workers:
        text += f" workers={len(workers)}x{max(workers):.0f}MB"
    if cuda := cuda_summary():
        text += f" {cuda}"
    return text


def _describe(proc: psutil.Process, role: str, cpu: float) -> str:
    with proc.oneshot():
        times = proc.cpu_times()
        return (
            f"{role:<7} pid={proc.pid} status={proc.status()} rss={process_rss_mb(proc):.0f}MB "
            f"cpu={cpu:.0f}% cpu_time={times.user + times.system:.1f}s fds={proc.num_fds()} "
            f"threads={proc.num_threads()} cmd={proc.name()}"
        )


def process_table(cpu_window_s: float = 0.2) -> list[str]:
    """One line per process, the rank first, then its children (dataloader workers, and what they
    run for `pipe:` shards): state, RSS, CPU % over `cpu_window_s`, CPU time, open fds, threads.
    CPU near 0 while stalled means blocked (I/O, lock, peer); near 100 means spinning."""
    me = psutil.Process()
    procs = [(me, "rank")]
    procs += [(c, "worker" if c.ppid() == me.pid else "child") for c in me.children(recursive=True)]
    for proc, _ in procs:
        try:
            proc.cpu_percent(None)  # starts the measuring window
        except psutil.Error:
            continue
    time.sleep(cpu_window_s)
    lines = []
    for proc, role in procs:
        try:
            lines.append(_describe(proc, role, proc.cpu_percent(None)))
        except psutil.Error as e:
            lines.append(f"{role:<7} pid={proc.pid} gone ({type(e).__name__})")
    return lines
