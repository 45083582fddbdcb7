"""Reader: a rank's heartbeat file (`ae.forensics.heartbeat` writes it), whether its process lives.

The file is replaced atomically, so a read sees a whole record; a file that does not parse, or
lacks HEARTBEAT_BASE_FIELDS, is treated as absent (heartbeats written before the step times have
no `timing`: theirs is None). `alive` is known only on the host that wrote it:
the pid exists, is not a zombie, and was started before the heartbeat was written (else the pid
was reused by another process).
"""

from __future__ import annotations

import json
import socket
from dataclasses import dataclass
from pathlib import Path

import psutil

from ae.log_lines import HEARTBEAT_BASE_FIELDS
from ae.stragglers import RankTiming


@dataclass(frozen=True)
class Heartbeat:
    path: Path
    rank: int
    world_size: int
    pid: int
    host: str
    phase: str
    epoch: int
    step: int
    time: float  # Unix seconds of the write
    last_progress: float  # Unix seconds of the rank's last progress beat
    rss_mb: float
    workers_rss_mb: float
    workers: int
    stalled: bool
    state: str  # running, exited, failed
    alive: bool | None  # None: written on another host
    timing: RankTiming | None = None  # step times and workers' read rates
    stragglers: tuple[dict, ...] = ()  # the detecting rank's straggler episodes
    resources: dict | None = None  # RESOURCE_FIELDS (None: a heartbeat written before them)
    main: str | None = None  # what the main thread is in (None: a heartbeat written before it)

    @property
    def rss_text(self) -> str:
        text = f"{self.rss_mb:.0f}MB"
        return text + (f" +{self.workers}w {self.workers_rss_mb:.0f}MB" if self.workers else "")


def process_alive(pid: int, host: str, started_by: float) -> bool | None:
    if host != socket.gethostname():
        return None
    try:
        proc = psutil.Process(pid)
        if proc.status() == psutil.STATUS_ZOMBIE:
            return False
        return proc.create_time() <= started_by + 1.0
    except psutil.NoSuchProcess:
        return False
    except psutil.Error:
        return None


def read_heartbeat(path: Path) -> Heartbeat | None:
    try:
        raw = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(raw, dict) or not set(HEARTBEAT_BASE_FIELDS) <= set(raw):
        return None
    try:
        workers = raw["workers"] or []
        return Heartbeat(
            path=path,
            rank=int(raw["rank"]),
            world_size=int(raw["world_size"]),
            pid=int(raw["pid"]),
            host=str(raw["host"]),
            phase=str(raw["phase"]),
            epoch=int(raw["epoch"]),
            step=int(raw["step"]),
            time=float(raw["time"]),
            last_progress=float(raw["last_progress"]),
            rss_mb=float(raw["rss_mb"]),
            workers_rss_mb=sum(float(w.get("rss_mb", 0.0)) for w in workers),
            workers=len(workers),
            stalled=bool(raw["stalled"]),
            state=str(raw["state"]),
            alive=process_alive(int(raw["pid"]), str(raw["host"]), float(raw["time"])),
            timing=RankTiming.from_heartbeat(raw),
            stragglers=tuple(e for e in raw.get("stragglers") or [] if isinstance(e, dict)),
            resources=raw["resources"] if isinstance(raw.get("resources"), dict) else None,
            main=str(raw["main"]) if raw.get("main") else None,
        )
    except (TypeError, ValueError, AttributeError):
        return None
