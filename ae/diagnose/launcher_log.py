"""Reader: how each rank process ended, in torchrun's own words (`launcher_<TS>.log`, which
`ae.job.torchrun` writes), or in the launcher's, for a rank it started itself (`RANK_ENDED`).

A rank killed by a signal (SIGKILL from the OOM killer or a user's `kill -9`) writes nothing: its
log just stops. torchrun, its parent, saw it end and says how, in two places:

    E1126 ... api.py:1002] failed (exitcode: -9) local_rank: 1 (pid: 25913) of binary: ...
    ...
      rank      : 1 (local_rank: 1)
      exitcode  : -9 (pid: 25913)  (SIGKILL)

A negative exit code is the signal that ended the process. The report's rank is the global rank;
the pid ties a line to a rank's heartbeat. The block under `Root Cause (first observed failure)`
is the rank torchrun saw end first, before it stopped the others. A rank with no torchrun above
it (one process on one node, a SLURM task) has the launcher's line instead, the same facts:

    Rank 0 (pid 25913) ended with exit code -9
"""

from __future__ import annotations

import re
import signal
from dataclasses import dataclass, replace
from pathlib import Path

from ae.diagnose.logscan import Evidence
from ae.log_lines import LAUNCHER_GONE, RANK_ENDED, RANK_LAUNCHER_GONE

_FAILED = re.compile(r"failed \(exitcode: (?P<code>-?\d+)\) local_rank: \d+ \(pid: (?P<pid>\d+)\)")
_BLOCK_RANK = re.compile(r"^\s*rank\s*: (?P<rank>\d+) \(local_rank: \d+\)")
_BLOCK_EXIT = re.compile(r"^\s*exitcode\s*: (?P<code>-?\d+) \(pid: (?P<pid>\d+)\)")
_ROOT_CAUSE = "Root Cause (first observed failure)"
# torchrun itself got a stop signal (the launcher passes on Ctrl-C and SIGTERM) and stops its ranks
_DEATH_SIGNAL = re.compile(r"Received (?P<sig>\d+) death signal, shutting down workers")


@dataclass(frozen=True)
class ProcessEnd:
    """A rank process's end as its parent saw it: an exit code, or the signal that killed it."""

    pid: int
    exit_code: int | None  # None when a signal ended it
    signal: str | None  # SIGKILL, SIGSEGV ...
    evidence: Evidence
    first: bool = False  # torchrun's root cause: the first rank it saw end

    @property
    def describe(self) -> str:
        return f"killed ({self.signal})" if self.signal else f"exited {self.exit_code}"


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def _end(pid: int, code: int, evidence: Evidence, first: bool = False) -> ProcessEnd:
    if code >= 0:
        return ProcessEnd(pid, code, None, evidence, first)
    return ProcessEnd(pid, None, _signal_name(-code), evidence, first)


@dataclass(frozen=True)
class StopSignal:
    """The stop signal torchrun received: the job was stopped from outside, not by a failure."""

    signal: str  # SIGINT, SIGTERM ...
    evidence: Evidence
    launcher_gone: int | None = None  # the pid of the launcher whose death sent it (SIGTERM)


@dataclass
class LauncherReport:
    by_pid: dict[int, ProcessEnd]
    by_rank: dict[int, ProcessEnd]  # from the report's blocks (global ranks)
    stopped: StopSignal | None = None


def read_launcher_logs(paths: list[Path]) -> LauncherReport:
    out = LauncherReport({}, {})
    for path in paths:
        try:
            lines = path.read_text(errors="replace").splitlines()
        except OSError:
            continue
        rank: int | None = None
        root = False
        for n, line in enumerate(lines, 1):
            if _ROOT_CAUSE in line:
                root = True
            elif (m := _DEATH_SIGNAL.search(line)) and out.stopped is None:
                out.stopped = StopSignal(_signal_name(int(m["sig"])), Evidence(path, n, line))
            elif (m := LAUNCHER_GONE.parse(line)) and out.stopped is not None:
                out.stopped = replace(out.stopped, launcher_gone=int(m["pid"]))
            elif (m := RANK_LAUNCHER_GONE.parse(line)) and out.stopped is None:
                # A rank the launcher started itself, sent SIGTERM by the kernel at its death
                ev = Evidence(path, n, line)
                out.stopped = StopSignal("SIGTERM", ev, launcher_gone=int(m["pid"]))
            elif m := RANK_ENDED.parse(line):
                pid, code = int(m["pid"]), int(m["code"])
                # Its only rank on this node, or (SLURM tasks sharing the file) the first to end
                end = _end(pid, code, Evidence(path, n, line), first=not out.by_rank)
                out.by_pid[pid] = out.by_rank.setdefault(int(m["rank"]), end)
            elif m := _FAILED.search(line):
                pid = int(m["pid"])
                out.by_pid.setdefault(pid, _end(pid, int(m["code"]), Evidence(path, n, line)))
            elif m := _BLOCK_RANK.match(line):
                rank = int(m["rank"])
            elif (m := _BLOCK_EXIT.match(line)) and rank is not None:
                pid = int(m["pid"])
                end = _end(pid, int(m["code"]), Evidence(path, n, line.strip()), root)
                if root or rank not in out.by_rank:
                    out.by_rank[rank] = end
                out.by_pid[pid] = end if root or pid not in out.by_pid else out.by_pid[pid]
                rank = None
    return out


# torchrun gave up waiting for the nodes to join, before any rank started: its static rendezvous
# (node 0's store counts the nodes that connected) and its c10d one (`--max_restarts`, no count)
_STORE_JOIN_TIMEOUT = re.compile(
    r"Timed out after \d+ seconds waiting for clients\. (?P<joined>\d+)/(?P<nodes>\d+) clients "
    r"joined"
)
_RDZV_TIMEOUT = "RendezvousTimeoutError"


def join_timed_out(text: str) -> tuple[int | None, int | None] | None:
    """Whether torchrun's output `text` ends its wait for the nodes to join: (nodes joined, nodes)
    where its static rendezvous counted them, (None, None) where the c10d one did not; None
    when it did not time out so."""
    if (m := _STORE_JOIN_TIMEOUT.search(text)) is not None:
        return int(m["joined"]), int(m["nodes"])
    return (None, None) if _RDZV_TIMEOUT in text else None
