"""Reader of the heartbeat's `resources` (`ae.forensics.resources` writes them): a culprit's
cause named as the resource that ran out: `disk full`, `shared memory exhausted`,
`out of memory (OOM killer)`, `too many open files` -- from the culprit's own lines and its
heartbeat's `resources` figures (`ae.forensics.resources`), which become evidence.

- `disk full`: a line saying ENOSPC (`No space left on device`, `Errno 28`, `Disk quota
  exceeded`, the rank's DISK_FULL line) that is not about shared memory.
- `shared memory exhausted`: ENOSPC about shared memory (`/dev/shm`, torch's `/torch_...`
  segments); or a SIGBUS (a worker's `Bus error`) or a stall in data loading (even one that
  ended in a collective) while the heartbeat had /dev/shm near full.
- `out of memory (OOM killer)`: a process killed by SIGKILL (a rank gone without trace, a
  dataloader worker `killed by signal: Killed`, or one killed while it handed a batch over: the
  rank's `EOFError` / `ConnectionResetError` in data loading, before torch could say why) while
  the cgroup's OOM-kill count had risen since the rank started, or host memory (or the cgroup's
  limit) was near exhausted.
- `too many open files`: EMFILE (`Too many open files`, `Errno 24`).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import replace
from typing import Any

from ae.diagnose.findings import Finding
from ae.diagnose.heartbeats import Heartbeat
from ae.diagnose.logscan import Evidence
from ae.diagnose.rank_log import RankLog
from ae.diagnose.tracebacks import Crash

DISK_FULL = "disk full"
SHM_EXHAUSTED = "shared memory exhausted"
OOM = "out of memory (OOM killer)"
TOO_MANY_FILES = "too many open files"

NEAR_FULL = 0.10  # /dev/shm with less than this share free is near full
MEMORY_NEAR_ZERO = 0.05  # host memory (or the cgroup's headroom) with less than this share left

_ENOSPC = re.compile(r"No space left on device|ENOSPC|Errno 28\b|Disk quota exceeded|Disk full")
_SHM_TEXT = re.compile(r"/dev/shm|/torch_\w+|shared memory|\bshm\b", re.I)
_EMFILE = re.compile(r"Too many open files|EMFILE|Errno 24\b")
_SIGBUS = re.compile(r"Bus error|SIGBUS")
_SIGKILL = re.compile(r"killed by signal: Killed|SIGKILL|DataLoader worker .* exited unexpectedly")
# The rank's end of a worker that died while handing a batch over (its descriptor, through
# multiprocessing's connection): torch never gets to report the worker's signal.
_HANDOVER_LOST = ("EOFError", "ConnectionResetError")


def _figures(hb: Heartbeat | None) -> dict[str, Any]:
    return dict(hb.resources or {}) if hb is not None else {}


def _share(free: float | None, total: float | None) -> float | None:
    return None if free is None or not total else free / total


def shm_near_full(res: dict[str, Any]) -> bool:
    share = _share(res.get("shm_free_mb"), res.get("shm_total_mb"))
    return share is not None and share < NEAR_FULL


def oom_killer_struck(res: dict[str, Any], hb: Heartbeat | None) -> str | None:
    """Why the OOM killer is the likely killer, or None."""
    kills, start = res.get("oom_kills"), res.get("oom_kills_at_start")
    if kills is not None and start is not None and kills > start:
        return f"cgroup OOM kills {start} -> {kills} since the rank started"
    share = _share(res.get("mem_available_mb"), res.get("mem_total_mb"))
    if share is not None and share < MEMORY_NEAR_ZERO:
        return f"host memory near zero: {res['mem_available_mb']:.0f} MB available"
    limit = res.get("cgroup_limit_mb")
    if limit and hb is not None and hb.rss_mb + hb.workers_rss_mb > (1 - MEMORY_NEAR_ZERO) * limit:
        return f"rank + workers {hb.rss_mb + hb.workers_rss_mb:.0f} MB at the cgroup limit"
    return None


def _mb(x: float | None) -> str:
    return "?" if x is None else f"{x:.1f} MB"


def _heartbeat_line(hb: Heartbeat, text: str) -> Evidence:
    return Evidence(hb.path, 0, f"heartbeat: {text}")


def _chain_lines(crash: Crash | None, pattern: re.Pattern[str]) -> list[Evidence]:
    """The lines of a chained exception that say how a process died (`... is killed by signal:
    Killed.` under torch's `exited unexpectedly`), placed at the crash's first line."""
    if crash is None:
        return []
    where = crash.evidence[0]
    said = {e.text for e in crash.evidence}
    return [
        Evidence(where.path, where.line, line)
        for line in crash.chain
        if pattern.search(line) and line not in said and "exited unexpectedly" not in line
    ][:1]


def _cause(f: Finding, r: RankLog) -> tuple[str, str, list[Evidence]] | None:
    """(cause, rule, extra evidence) when a resource explains the finding."""
    hb = r.heartbeat
    res = _figures(hb)
    crash = next((c for c in r.crashes if c.time == f.time), None)
    lines = [e.text for e in f.evidence] + ([crash.message, *crash.chain] if crash else [])
    text = "\n".join(lines)
    shm = f"/dev/shm {_mb(res.get('shm_free_mb'))} free of {_mb(res.get('shm_total_mb'))}"
    disk_free, disk_total = _mb(res.get("disk_free_mb")), _mb(res.get("disk_total_mb"))
    disk = f"output folder disk {disk_free} free of {disk_total}"
    extra: list[Evidence] = []
    if _ENOSPC.search(text) and _SHM_TEXT.search(text):
        if hb is not None:
            extra.append(_heartbeat_line(hb, shm))
        return SHM_EXHAUSTED, "a write to shared memory found no space", extra
    if _ENOSPC.search(text):
        if hb is not None:
            extra.append(_heartbeat_line(hb, disk))
        return DISK_FULL, "a write found no space left on device", extra
    if _EMFILE.search(text):
        if hb is not None:
            fds = f"{res.get('open_fds')} open fds, ulimit -n {res.get('fd_limit')}"
            extra.append(_heartbeat_line(hb, fds))
        return TOO_MANY_FILES, "a file or socket could not be opened (EMFILE)", extra
    if hb is None:
        return None
    sigbus = _SIGBUS.search(text) or (crash is not None and crash.kind == "SIGBUS")
    if sigbus and shm_near_full(res):
        extra = [*_chain_lines(crash, _SIGBUS), _heartbeat_line(hb, shm)]
        return SHM_EXHAUSTED, "SIGBUS while /dev/shm was near full", extra
    stuck = f.cause in ("data loading", "collective wait")  # a stall, not a failure of its own
    if stuck and f.phase == "data loading" and shm_near_full(res):
        rule = "stuck in data loading while /dev/shm was near full"
        return SHM_EXHAUSTED, rule, [_heartbeat_line(hb, shm)]
    lost_worker = crash is not None and crash.kind in _HANDOVER_LOST and f.phase == "data loading"
    killed = f.cause == "killed without trace" or _SIGKILL.search(text) or lost_worker
    if killed and (why := oom_killer_struck(res, hb)):
        mem = f"{why}; host memory {_mb(res.get('mem_available_mb'))} available"
        return (
            OOM,
            "killed by SIGKILL while memory ran out",
            [*_chain_lines(crash, _SIGKILL), _heartbeat_line(hb, mem)],
        )
    return None


def name_resources(culprits: Iterable[Finding], ranks: dict[int, RankLog]) -> list[Finding]:
    """The culprits, each that a resource explains with that resource as its cause, the
    heartbeat's figures appended to its evidence; the former cause moves into the rule."""
    named = []
    for f in culprits:
        r = ranks.get(f.rank)
        if r is not None and (found := _cause(f, r)) is not None:
            cause, rule, extra = found
            f = replace(
                f, cause=cause, rule=f"{rule} (was: {f.cause})", evidence=[*f.evidence, *extra]
            )
        named.append(f)
    return named
