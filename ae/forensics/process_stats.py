"""Memory and process figures of a rank and its dataloader workers (psutil), and of its GPU.

`memory_summary()` goes on every debug `Training step` line, so it must stay cheap (see
`RssReader`, SUMMARY_REFRESH_S). `process_table()` is for stall reports: state, RSS, CPU, open
fds and threads of the rank and each child.
"""

from __future__ import annotations

import contextlib
import os
import time

import psutil
import torch

_MB = 2**20
CHILDREN_REFRESH_S = 2.0
# Reading /proc with cold caches costs tens of microseconds: a few percent of a small model's
# step. The per-step summary is re-read at most this often (its figures are that old at most).
SUMMARY_REFRESH_S = 0.1


def process_rss_mb(proc: psutil.Process | None = None) -> float:
    return (proc or psutil.Process()).memory_info().rss / _MB


class RssReader:
    """RSS of this process and its direct children (dataloader workers), cheaply: for the
    per-step line and the heartbeat. One reader per thread (it keeps state).

    Reads `/proc/<pid>/statm` with one `pread` on a descriptor kept open (~2 us, where psutil's
    `memory_info` costs 15-30 us); the children come from `/proc/self/task/*/children`, re-read
    at most every CHILDREN_REFRESH_S (workers start and stop with each epoch's iterator).
    """

    def __init__(self) -> None:
        self.pid = -1
        self.fds: dict[int, int] = {}  # pid -> open statm descriptor
        self.listed_at = 0.0

    def _reset(self) -> None:
        for fd in self.fds.values():
            os.close(fd)
        self.fds = {}
        self.pid = os.getpid()
        self.listed_at = -CHILDREN_REFRESH_S
        self._open(self.pid)

    def _open(self, pid: int) -> None:
        with contextlib.suppress(OSError):  # already gone
            self.fds[pid] = os.open(f"/proc/{pid}/statm", os.O_RDONLY)

    def _relist(self) -> None:
        try:
            children = set()
            for tid in os.listdir("/proc/self/task"):
                with open(f"/proc/self/task/{tid}/children") as f:
                    children.update(int(pid) for pid in f.read().split())
        except OSError:  # a kernel without CONFIG_PROC_CHILDREN
            children = {c.pid for c in psutil.Process().children()}
        for pid in set(self.fds) - children - {self.pid}:
            os.close(self.fds.pop(pid))
        for pid in children - set(self.fds):
            self._open(pid)

    def _rss_mb(self, pid: int) -> float:
        try:
            pages = int(os.pread(self.fds[pid], 64, 0).split()[1])
        except (OSError, IndexError, ValueError):  # the process is gone
            return 0.0
        return pages * _PAGE / _MB

    def sample(self) -> tuple[float, dict[int, float]]:
        """(RSS of this process, {pid: RSS} of each live child) in MB."""
        if self.pid != os.getpid():  # first use, or a forked child using the module
            self._reset()
        now = time.monotonic()
        if now - self.listed_at >= CHILDREN_REFRESH_S:
            self._relist()
            self.listed_at = now
        children = {pid: self._rss_mb(pid) for pid in self.fds if pid != self.pid}
        return self._rss_mb(self.pid), {pid: mb for pid, mb in children.items() if mb > 0}


_reader = RssReader()  # the training loop's
_PAGE = os.sysconf("SC_PAGE_SIZE")


def cuda_summary(device: int | None = None) -> str:
    """`cuda=1.20/3.40GB peak=2.00GB` (allocated/reserved, peak allocated), or "" without CUDA.
    Reads the caching allocator's counters only (no driver call that could block on a hung GPU)."""
    if not torch.cuda.is_initialized():  # cheaper than is_available(), and implies it
        return ""
    alloc = torch.cuda.memory_allocated(device) / 2**30
    reserved = torch.cuda.memory_reserved(device) / 2**30
    peak = torch.cuda.max_memory_allocated(device) / 2**30
    return f"cuda={alloc:.2f}/{reserved:.2f}GB peak={peak:.2f}GB"


_summary = (float("-inf"), "")  # (monotonic time, text)


def memory_summary() -> str:
    """`rss=812MB workers=3x120MB` (largest worker) plus the CUDA figures on GPU, at most
    SUMMARY_REFRESH_S old."""
    global _summary
    now = time.monotonic()
    if now - _summary[0] >= SUMMARY_REFRESH_S:
        _summary = (now, _read_summary())
    return _summary[1]


def _read_summary() -> str:
    rss, children = _reader.sample()
    workers = list(children.values())
    text = f"rss={rss:.0f}MB"
    if workers:
        text += f" workers={len(workers)}x{max(workers):.0f}MB"
    if cuda := cuda_summary():
        text += f" {cuda}"
    return text


# Process names of the rank and its dataloader workers (torch renames them); any other child
# is a command a shard is read through (curl, `pipe:CMD` and its shell).
_PYTHON_NAMES = ("python", "pt_data_worker", "pt_main_thread")
CMDLINE_CHARS = 300


def _is_python(proc: psutil.Process) -> bool:
    with contextlib.suppress(psutil.Error):
        return proc.name().startswith(_PYTHON_NAMES)
    return True


def _command(proc: psutil.Process) -> str:
    """The name of a Python process; the command line of any other (`curl ... URL`: which
    shard a stalled read waits for, named)."""
    if _is_python(proc):
        return proc.name()
    with contextlib.suppress(psutil.Error):
        line = " ".join(proc.cmdline())
        return line if len(line) <= CMDLINE_CHARS else line[: CMDLINE_CHARS - 3] + "..."
    return proc.name()


def _describe(proc: psutil.Process, role: str, cpu: float) -> str:
    with proc.oneshot():
        times = proc.cpu_times()
        return (
            f"{role:<7} pid={proc.pid} status={proc.status()} rss={process_rss_mb(proc):.0f}MB "
            f"cpu={cpu:.0f}% cpu_time={times.user + times.system:.1f}s fds={proc.num_fds()} "
            f"threads={proc.num_threads()} cmd={_command(proc)}"
        )


def process_table(cpu_window_s: float = 0.2) -> list[str]:
    """One line per process, the rank first, then its children (dataloader workers, and what they
    run for remote and `pipe:` shards, with its command line): state, RSS, CPU % over
    `cpu_window_s`, CPU time, open fds, threads.
    CPU near 0 while stalled means blocked (I/O, lock, peer); near 100 means spinning."""
    me = psutil.Process()
    procs = [(me, "rank")]
    procs += [
        (c, "worker" if c.ppid() == me.pid and _is_python(c) else "child")
        for c in me.children(recursive=True)
    ]
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


def kill_descendants(pid: int | None = None) -> int:
    """SIGKILL every process below `pid` (this one by default): how many. For a rank that ends
    itself (`--hang_timeout`): its dataloader workers, blocked in a read, never see it go, and
    the command a remote shard is read through (curl on a server gone silent) would wait
    forever, orphaned."""
    try:
        family = psutil.Process(pid).children(recursive=True)
    except psutil.Error:
        return 0
    killed = 0
    for proc in family:
        with contextlib.suppress(psutil.Error):
            proc.kill()
            killed += 1
    return killed
