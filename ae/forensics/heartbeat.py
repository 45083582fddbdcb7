"""Writer: the heartbeat file of a rank, `<logs>/heartbeat_rank<N>_<TS>.json`, what it does now
(`ae.diagnose.heartbeats` reads it).

The watchdog thread rewrites it every few seconds, so a live job can be inspected (`cat`, or
`ae-diagnose`) while every rank is blocked. Each write goes to a temporary file in the same
folder and is renamed over the old one (`ae.atomic_files`): a reader sees the previous or the
new content, never a torn file. A stale `time` means the rank's watchdog thread itself stopped
(process dead, frozen, or the interpreter lock held by native code).
"""

from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path
from typing import Any

from ae import atomic_files
from ae.forensics.process_stats import RssReader
from ae.forensics.progress import Progress
from ae.forensics.stall_report import main_thread_doing
from ae.forensics.step_times import StepTimes, step_times
from ae.log_lines import HEARTBEAT_FIELDS, HEARTBEAT_FILE
from logging_cfg import RankContext


def heartbeat_path(logs_dir: Path, rank: int, run_ts: str) -> Path:
    return Path(logs_dir) / HEARTBEAT_FILE.format(rank=rank, ts=run_ts)


def heartbeat_record(
    ctx: RankContext,
    progress: Progress,
    rss: RssReader,
    *,
    stalled: bool,
    state: str = "running",
    times: StepTimes = step_times,
    stragglers: list[dict[str, Any]] | None = None,
    resources: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The HEARTBEAT_FIELDS of this rank now. `state`: `running`; at the end `exited`, or
    `failed` when the rank left with an exception. `stragglers`: the episodes of the detecting
    rank (`ae.forensics.stragglers`), empty elsewhere; `resources`: a `ResourceReader` sample;
    `main`: what the main thread is in (called from the watchdog thread)."""
    now = time.time()
    rss_mb, workers = rss.sample()
    record = {
        "rank": ctx.rank,
        "world_size": ctx.world_size,
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "phase": progress.phase,
        "epoch": progress.epoch,
        "step": progress.step,
        "time": round(now, 3),
        "last_progress": round(progress.last_beat_wall, 3),
        "idle_s": round(progress.idle_s(), 1),
        "rss_mb": round(rss_mb, 1),
        "workers": [{"pid": pid, "rss_mb": round(mb, 1)} for pid, mb in workers.items()],
        "stalled": stalled,
        "state": state,
        **times.heartbeat(),
        "stragglers": stragglers or [],
        "resources": resources,
        "main": main_thread_doing(progress.phase),
    }
    assert tuple(record) == HEARTBEAT_FIELDS
    return record


def write_heartbeat(path: Path, record: dict[str, Any]) -> None:
    """Atomic rewrite, not fsynced: it is rewritten every few seconds, and a heartbeat is of use
    while the machine is up."""
    atomic_files.write(path, (json.dumps(record, indent=1) + "\n").encode(), durable=False)
