"""The content of a STALL report: where the rank's main thread is blocked, whether that looks like
a wait in a collective, the Python stacks of every thread, its processes and CUDA memory.

Everything here reads local state only (frames, /proc, allocator counters): it never makes a
collective call, so it works while the job is hung. Dataloader workers are separate processes:
`dump_worker_stacks` asks each one to write its own stacks into the debug log (faulthandler on
SIGUSR1, inherited when torch forks the worker).
"""

from __future__ import annotations

import os
import re
import signal
import sys
import sysconfig
import threading
import time
import traceback
from types import FrameType

import psutil
import torch

from ae.forensics.process_stats import cuda_summary, process_table

# Innermost frames of a rank blocked in a collective: torch.distributed's collectives and their
# Lightning wrappers (barrier, reduce, the per-step SIGTERM broadcast), and DDP's gradient
# all-reduce, which the autograd engine waits for at the end of `backward`.
_COLLECTIVE_NAME = re.compile(
    r"all_?reduce|all_?gather|broadcast|barrier|reduce_scatter|all_?to_all|"
    r"^(wait|gather|scatter|reduce|send|recv)$"
)
_COLLECTIVE_PATHS = ("torch/distributed/", "torch/nn/parallel/", "lightning/")
_BACKWARD = ("torch/autograd/", ("_engine_run_backward", "backward"))
_C10D_LOGGER = "torch/distributed/c10d_logger.py"
_COLLECTIVE_DEPTH = 4  # only the innermost frames: outer ones are the training loop around it
# A collective called by a DDP comm hook (ae's reduces on the training thread on gloo): backward
# is at most this many frames further out (the hook, its lambda, c10d's logging wrapper).
_HOOK_DEPTH = 4


def main_thread_frame() -> FrameType | None:
    return sys._current_frames().get(threading.main_thread().ident or -1)


def _short(path: str) -> str:
    """Path without the site-packages, standard-library or working-directory prefix."""
    _, sep, rest = path.rpartition("site-packages/")
    if sep:
        return rest
    for prefix in (sysconfig.get_paths()["stdlib"], os.getcwd()):
        if path.startswith(prefix + os.sep):
            return path[len(prefix) + 1 :]
    return path


def describe_frame(frame: FrameType | None) -> str:
    """`function (file:line)` of the innermost frame."""
    if frame is None:
        return "unknown"
    return f"{frame.f_code.co_name} ({_short(frame.f_code.co_filename)}:{frame.f_lineno})"


def _ddp_active() -> bool:
    dist = torch.distributed
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def collective_wait(frame: FrameType | None) -> str:
    """`no`, or `yes (<function>)` when the innermost frames are a collective call; DDP's
    gradient all-reduce when they are backward, or a collective that a comm hook called in it."""
    found = None
    depth = 0
    while depth < _COLLECTIVE_DEPTH + _HOOK_DEPTH:
        if frame is None or (found is None and depth >= _COLLECTIVE_DEPTH):
            break
        path = frame.f_code.co_filename.replace(os.sep, "/")
        name = frame.f_code.co_name
        if _C10D_LOGGER in path:  # the logging wrapper of every collective: part of the call
            frame = frame.f_back  # (a failed one logs from there: its peer left, say)
            continue
        depth += 1
        if _BACKWARD[0] in path and name in _BACKWARD[1] and _ddp_active():
            return "yes (DDP gradient all-reduce in backward)"
        if (found is None and any(p in path for p in _COLLECTIVE_PATHS)
                and _COLLECTIVE_NAME.search(name)):  # fmt: skip
            found = f"yes ({name})"
        frame = frame.f_back
    return found or "no"


def main_thread_doing(phase: str) -> str | None:
    """What the main thread is in now, for the heartbeat (`ae-diagnose --watch`): `collective:
    <what>`, `data loading`, or `code: <function (file:line)>` (its innermost frame: the
    user's model, a checkpoint write ...); None when asked from the main thread itself (its
    last heartbeat, on its way out)."""
    if threading.current_thread() is threading.main_thread():
        return None
    frame = main_thread_frame()
    try:
        return frame_doing(frame, phase)
    finally:
        del frame  # a frame reference keeps the whole stack alive


def frame_doing(frame: FrameType | None, phase: str) -> str:
    """What a thread whose innermost frame is `frame` does, in `phase`: `collective: <what>`,
    `data loading`, or `code: <function (file:line)>`. Frame reads only: safe in a signal
    handler (the stop signal's, for a rank that leaves stuck)."""
    wait = collective_wait(frame)
    if wait != "no":
        return f"collective: {wait.removeprefix('yes (').removesuffix(')')}"
    return "data loading" if phase == "data loading" else f"code: {describe_frame(frame)}"


def thread_stacks(skip_ident: int | None = None) -> str:
    """Python stacks of every thread (main thread first), most recent call last."""
    frames = sys._current_frames()
    threads = {t.ident: t for t in threading.enumerate()}
    main = threading.main_thread().ident
    order = sorted(frames, key=lambda ident: ident != main)
    parts = []
    for ident in order:
        if ident == skip_ident:
            continue
        t = threads.get(ident)
        name = t.name if t else "<native>"
        daemon = " daemon" if t is not None and t.daemon else ""
        stack = "".join(traceback.format_stack(frames[ident])).rstrip()
        parts.append(f"Thread {name} (ident {ident}{daemon}):\n{stack}")
    return "\n".join(parts)


def report_body(frame: str, collective: str, cuda_device: int | None) -> str:
    lines = [f"main thread in: {frame}; collective wait: {collective}", "processes:"]
    lines += [f"  {line}" for line in process_table()]
    if cuda := cuda_summary(cuda_device):
        lines.append(f"cuda: {cuda}")
    lines.append("stacks (all threads but the watchdog):")
    lines.append(thread_stacks(skip_ident=threading.get_ident()))
    return "\n".join(lines)


def _catches_sigusr1(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("SigCgt:"):
                    return bool(int(line.split()[1], 16) >> (signal.SIGUSR1 - 1) & 1)
    except OSError:
        pass
    return False


def dump_worker_stacks(gap_s: float = 0.1) -> list[int]:
    """SIGUSR1 to each forked dataloader worker; their faulthandler writes its stacks to the
    debug log. Only children that are forks of this process (same command line) and catch
    SIGUSR1: the default action of SIGUSR1 is to terminate, e.g. a `pipe:` shard command.
    One at a time, `gap_s` apart, so their dumps do not interleave. Returns the pids."""
    me = psutil.Process()
    cmdline = me.cmdline()
    signalled = []
    for child in me.children():
        try:
            if child.cmdline() != cmdline or not _catches_sigusr1(child.pid):
                continue
            os.kill(child.pid, signal.SIGUSR1)
        except (psutil.Error, OSError):
            continue
        signalled.append(child.pid)
        time.sleep(gap_s)
    return signalled
