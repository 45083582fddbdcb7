"""Memory figures of a rank and its dataloader workers (psutil), and of its GPU."""

from __future__ import annotations

import psutil
import torch

_MB = 2**20


def process_rss_mb(proc: psutil.Process | None = None) -> float:
    return (proc or psutil.Process()).memory_info().rss / _MB


def workers_rss_mb() -> list[float]:
    """RSS of each child process (dataloader workers), in MB; vanished children are skipped."""
    out = []
    for child in psutil.Process().children(recursive=True):
        try:
            out.append(child.memory_info().rss / _MB)
        except psutil.Error:
            continue
    return out


def memory_summary() -> str:
    """`rss=812MB workers=3x120MB` plus `cuda=1.2/3.4GB` (allocated/reserved) on GPU."""
    workers = workers_rss_mb()
    text = f"rss={process_rss_mb():.0f}MB"
    if workers:
        text += f" workers={len(workers)}x{max(workers):.0f}MB"
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        alloc = torch.cuda.memory_allocated() / 2**30
        reserved = torch.cuda.memory_reserved() / 2**30
        text += f" cuda={alloc:.2f}/{reserved:.2f}GB"
    return text
