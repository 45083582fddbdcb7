"""Everything `ae-diagnose` knows about a run: each rank's state, the train log, the time frame.

Times: log lines carry the writer's local time, heartbeats Unix seconds; both become Unix seconds
(same host, or clocks in sync, as a multi-node job needs anyway). `newest_line` is the newest
record of any file of the run: silence is measured from it, not from the clock of the machine
reading the logs, so a dead run reads the same tomorrow.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

from ae.diagnose.collectives import Backend, backend_words
from ae.diagnose.flight_recorder import Dump, read_dump
from ae.diagnose.heartbeats import read_heartbeat
from ae.diagnose.launcher_log import LauncherReport, ProcessEnd, StopSignal, read_launcher_logs
from ae.diagnose.log_files import RunFiles
from ae.diagnose.logscan import LogBytes, Record
from ae.diagnose.rank_log import RankLog, read_rank
from ae.diagnose.tracebacks import Crash
from ae.log_lines import RECORD_PATTERN, RESOLVED_CONFIG, STRAGGLER, STRAGGLER_RESOLVED

_STALL_TIMEOUT = re.compile(r"^stall_timeout: (?P<value>\S+)$", re.M)
_NUM_WORKERS = re.compile(r"^num_workers: (?P<value>\d+)$", re.M)


@dataclass
class TrainLog:
    last: Record | None = None
    world_size: int | None = None
    config: str | None = None  # the resolved config, YAML
    # rank -> its STRAGGLER line, for the episodes with no STRAGGLER RESOLVED after them
    stragglers: dict[int, Record] = field(default_factory=dict)

    @property
    def stall_timeout(self) -> float | None:
        m = None if self.config is None else _STALL_TIMEOUT.search(self.config)
        try:
            return None if m is None else float(m["value"])
        except ValueError:
            return None

    @property
    def num_workers(self) -> int | None:
        """The run's `--num_workers`, from its resolved config (the advice to an input-bound
        job names it)."""
        m = None if self.config is None else _NUM_WORKERS.search(self.config)
        return None if m is None else int(m["value"])


@dataclass
class RunState:
    files: RunFiles
    ranks: dict[int, RankLog]
    train: TrainLog
    world_size: int | None
    missing: list[int]
    newest_line: float | None  # newest record line of the run
    reference: float | None  # newest of the lines and the heartbeat writes
    dumps: dict[int, Dump] = field(default_factory=dict)  # rank -> its Flight Recorder dump
    backend: dict[int, Backend] = field(default_factory=dict)  # rank -> its backend's words
    # rank -> how its process ended, when torchrun's report says (no exit line of its own)
    ends: dict[int, ProcessEnd] = field(default_factory=dict)
    # rank -> how its process ended after its exit line, when not with that code: killed in its
    # last moments (interpreter shutdown), which its log cannot say (`ae.diagnose.teardown`)
    after_exit: dict[int, ProcessEnd] = field(default_factory=dict)
    # ranks with an exit line of their own (a user error's exit 2) whose end torchrun's report
    # names as the first it saw: the peers it SIGTERMed after it are its victims (`deaths`)
    exited_first: set[int] = field(default_factory=set)
    stopped: StopSignal | None = None  # torchrun's own stop signal (Ctrl-C, SIGTERM passed on)

    def silent_s(self, rank: RankLog) -> float | None:
        if self.newest_line is None or rank.last_time is None:
            return None
        return max(0.0, self.newest_line - rank.last_time)

    def idle_s(self, rank: RankLog) -> float | None:
        """Seconds since the rank's last progress (step, marker, heartbeat beat)."""
        if self.reference is None or rank.progress_time is None:
            return None
        return max(0.0, self.reference - rank.progress_time)


def read_train_log(paths: list[Path]) -> TrainLog:
    out = TrainLog()
    for path in paths:
        log = LogBytes.read(path)
        if (start := log.last_record()) is not None:
            out.last = log.record(start) or out.last
            out.world_size = out.world_size or (out.last.world if out.last else None)
        start = log.rfind_record(f"] {RESOLVED_CONFIG}".encode())
        if start is not None:
            out.config = "\n".join(log.text(p) for p in log.continuation(start, 1000))
        _stragglers(log, out.stragglers)
    return out


def _stragglers(log: LogBytes, open_episodes: dict[int, Record]) -> None:
    """Follow the STRAGGLER / STRAGGLER RESOLVED lines in file order (the `] STRAGGLER ` needle
    finds both)."""
    for start in log.find_records(f"] {STRAGGLER.prefix.split()[0]} ".encode()):
        rec = log.record(start)
        if rec is None:
            continue
        if m := STRAGGLER.parse(rec.message):
            open_episodes[int(m["rank"])] = rec
        elif m := STRAGGLER_RESOLVED.parse(rec.message):
            open_episodes.pop(int(m["rank"]), None)


def _worker_crash(c: Crash) -> bool:
    m = RECORD_PATTERN.match(c.evidence[0].text) if c.evidence else None
    return m is not None and m["worker"] is not None


def _end_of(report: LauncherReport, rank: int, r: RankLog) -> ProcessEnd | None:
    """How torchrun's report says the rank's process ended (by the heartbeat's pid, else the
    rank), or None."""
    hb = r.heartbeat
    end = report.by_pid.get(hb.pid) if hb is not None else None
    return end or report.by_rank.get(rank)


def ends_after_exit(report: LauncherReport, ranks: dict[int, RankLog]) -> dict[int, ProcessEnd]:
    """Rank -> how its process ended, for the ranks whose exit line says another code: a
    signal after `Rank exiting with code 0` (a kill in its last moments)."""
    ends = {rank: _end_of(report, rank, r) for rank, r in ranks.items() if r.exit is not None}
    return {
        rank: end for rank, end in ends.items()
        if end is not None and (end.signal is not None or end.exit_code != ranks[rank].exit_code)
    }  # fmt: skip


def process_ends(report: LauncherReport, ranks: dict[int, RankLog]) -> dict[int, ProcessEnd]:
    """Rank -> how its process ended (a signal, a non-zero exit code), for the ranks that wrote
    no exit line of their own, from torchrun's report (by the heartbeat's pid, else the rank).
    The dataloader workers of such a rank outlived it: their exceptions (a socket to the dead
    rank reset) are dropped, never taken for the rank's own cause."""
    ends = {}
    for rank, r in ranks.items():
        hb = r.heartbeat
        end = _end_of(report, rank, r)
        if r.exit is not None or (end is not None and end.exit_code == 0):
            continue
        if end is not None:
            ends[rank] = end
        if end is not None or (hb is not None and hb.alive is False):
            r.crashes = [c for c in r.crashes if not _worker_crash(c)]
    return ends


def exited_first(report: LauncherReport, ranks: dict[int, RankLog]) -> set[int]:
    """The ranks that wrote an exit line of their own and whose end torchrun's report names as
    the first it saw."""
    ends = {rank: _end_of(report, rank, r) for rank, r in ranks.items() if r.exit is not None}
    return {rank for rank, end in ends.items() if end is not None and end.first}


def read_run(files: RunFiles, max_shard_errors: int = 1000) -> RunState:
    ranks: dict[int, RankLog] = {}
    for rank in sorted(set(files.debug_logs) | set(files.heartbeats)):
        beat = read_heartbeat(files.heartbeats[rank]) if rank in files.heartbeats else None
        ranks[rank] = read_rank(rank, files.debug_logs.get(rank, []), beat, max_shard_errors)
    train = read_train_log(files.train_logs)
    report = read_launcher_logs(files.launcher_logs)
    ends = process_ends(report, ranks)
    worlds = [r.world_size for r in ranks.values() if r.world_size] + [train.world_size or 0]
    world = max(worlds) or None
    expected = set(range(world)) if world else set()
    missing = sorted(expected - {r for r, s in ranks.items() if s.files})
    lines = [r.last_time for r in ranks.values() if r.last_time is not None]
    if train.last is not None:
        lines.append(train.last.time)
    beats = [r.heartbeat.time for r in ranks.values() if r.heartbeat is not None]
    dumps = {rank: d for rank, path in files.collectives.items() if (d := read_dump(path, rank))}
    return RunState(
        files=files,
        ranks=ranks,
        train=train,
        world_size=world,
        missing=missing,
        newest_line=max(lines) if lines else None,
        reference=max(lines + beats) if lines or beats else None,
        dumps=dumps,
        backend=backend_words(files.native_logs),
        ends=ends,
        after_exit=ends_after_exit(report, ranks),
        exited_first=exited_first(report, ranks),
        stopped=report.stopped,
    )
