"""One rank's state, read from its debug log(s) and heartbeat: where it was last, how it ended.

Counts (errors, warnings, stall reports, bad-shard lines) need a pass over the whole file; the
last state (line, marker, step, memory, exit line) is searched backwards from the end. Every
search is a literal `find` (see logscan): the ERROR, STALL, FATAL and marker needles are built
from the same LineFormats the writers use.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, replace
from pathlib import Path

from ae.diagnose.heartbeats import Heartbeat
from ae.diagnose.logscan import Evidence, LogBytes, Record, message_needle
from ae.diagnose.phases import phase_after_marker
from ae.diagnose.tracebacks import (
    FAULTHANDLER_TIMEOUT,
    Crash,
    busy_worker_frames,
    main_thread_frame,
    read_crashes,
)
from ae.log_lines import (
    CHECKPOINT_END,
    CHECKPOINT_START,
    CLOCK_OFFSET,
    EPOCH_MARKER_NAME,
    LOSS_SPIKE,
    MARKER,
    NONFINITE,
    NONFINITE_INPUT,
    NONFINITE_SKIPPED,
    PREEMPTED,
    PROCESSED_TRAIN,
    RANK_EXIT,
    RANK_PROCESS,
    ROLLBACK,
    SAMPLING_END,
    SAMPLING_START,
    SHARD_PLAN,
    STALL,
    STALL_REPORT,
    STALL_RESOLVED,
    STOP_SIGNAL,
    STOP_SIGNAL_STUCK,
    STUCK_MAIN_THREAD,
    TRAIN_STEP,
    TRAINING_FINISHED,
    VAL_STEP,
    saves_step_file,
)

# STALL RESOLVED `now` (ae.forensics.watchdog: `phase <phase>, step <n>`): a rank gone to teardown.
_TEARDOWN = "phase teardown"
_MEMORY = re.compile(r"\brss=\S+(?: workers=\S+)?(?: cuda=\S+ peak=\S+)?")
_SHARD = re.compile(r"(\S+\.tar)\b")
_NONFINITE_INPUT = NONFINITE_INPUT.encode()
ERROR_LINES = 20  # continuation lines of an ERROR record kept (a user error's whole message)
SPIKES_KEPT = 20


# The lines that name the optimizer step the rank was at: its step is the newest of them (or the
# heartbeat's, when newer). The training step lines come only every few batches; a checkpoint, a
# sampling, a stall or a stop signal since then says the step too.
_STEP_LINES = (TRAIN_STEP, CHECKPOINT_START, CHECKPOINT_END, SAMPLING_START, SAMPLING_END, STALL,
               STOP_SIGNAL, STOP_SIGNAL_STUCK, PREEMPTED)  # fmt: skip

# The rank got a stop signal (torchrun stopping a failed job, preemption): ae's own lines, and
# Lightning's (its handler is the one in place before training starts).
_STOP_SIGNAL_NEEDLES = (
    message_needle(STOP_SIGNAL.prefix),
    message_needle(STOP_SIGNAL_STUCK.prefix),
    b"Received SIGTERM",
)
# STOP_SIGNAL_STUCK's own words (its text after the last field; its prefix is STOP_SIGNAL's)
_STUCK_NEEDLE = STOP_SIGNAL_STUCK.template.rsplit("}", 1)[1].encode()


@dataclass
class Stall:
    evidence: list[Evidence]  # the STALL line, then the innermost frame of each worker's dump
    time: float
    phase: str
    epoch: int
    step: int
    idle: float
    collective: str

    @property
    def waiting(self) -> bool:
        """Blocked in a collective: waiting for a peer, not the cause."""
        return self.collective.startswith("yes")

    @property
    def began(self) -> float:
        return self.time - self.idle


@dataclass
class RankLog:
    rank: int
    files: list[Path]
    world_size: int | None = None
    last: Record | None = None
    marker: Record | None = None
    marker_name: str = ""
    marker_edge: str = ""
    step: int | None = None
    step_time: float | None = None
    epoch: int | None = None
    progress_time: float | None = None
    memory: str | None = None
    errors: int = 0
    warnings: int = 0
    stall_reports: int = 0
    open_stall: Stall | None = None
    resolved_stall: Stall | None = None  # the newest stall that ended in progress (not teardown)
    crashes: list[Crash] = field(default_factory=list)
    exit: Record | None = None
    exit_code: int | None = None
    last_error: Evidence | None = None
    last_error_more: list[Evidence] = field(default_factory=list)  # its continuation lines
    shard_plans: dict[str, dict[str, str]] = field(default_factory=dict)
    shard_errors: list[Record] = field(default_factory=list)
    shard_error_lines: int = 0
    native_dump: Evidence | None = None
    native_dump_main: Evidence | None = None  # the innermost frame of the main thread in it
    sigterm: Record | None = None
    # Its STOP_SIGNAL_STUCK line: the stop signal found it without progress, and it left
    stuck_stop: Record | None = None
    # Its TRAINING_FINISHED line: its fit returned after the last step (the ranks step together,
    # so training is over for every rank); whatever follows is teardown.
    training_finished: Record | None = None
    saved: Record | None = None  # its last CHECKPOINT_END line of a step file (not `best`)
    preempted: Record | None = None  # its PREEMPTED line: stopped by a signal, checkpoint saved
    heartbeat: Heartbeat | None = None
    header_host: str | None = None  # from the rank header, for a rank without a heartbeat
    # Non-finite values (ae.training.nonfinite): the rank's first NONFINITE line and its last
    # (after skipped or rolled-back steps, the one that stopped the run), the steps it skipped
    # and rolled back, its loss spikes (the first SPIKES_KEPT).
    nonfinite: Record | None = None
    nonfinite_last: Record | None = None
    skipped_steps: int = 0
    rollbacks: int = 0
    spikes: list[Record] = field(default_factory=list)

    @property
    def host(self) -> str | None:
        return self.heartbeat.host if self.heartbeat is not None else self.header_host

    @property
    def last_time(self) -> float | None:
        return None if self.last is None else self.last.time

    @property
    def last_sign_of_life(self) -> float | None:
        """The newest of its last line and its heartbeat's last write."""
        times = [t for t in (self.last_time, self.heartbeat and self.heartbeat.time) if t]
        return max(times) if times else None

    @property
    def log_phase(self) -> str | None:
        if self.marker is None:
            return None
        return phase_after_marker(self.marker_name, self.marker_edge)

    def _stop_line(self) -> dict[str, str] | None:
        """The fields of its stop signal line (ae's own; None for Lightning's `Received SIGTERM`,
        which names neither a phase nor a signal, and without one)."""
        if self.sigterm is None:
            return None
        for fmt in (STOP_SIGNAL, STOP_SIGNAL_STUCK):
            if (m := fmt.parse(self.sigterm.message)) is not None:
                return m
        return None

    @property
    def stop_phase(self) -> str | None:
        """The phase its stop signal line names (`... in phase teardown at step 23`), if any."""
        line = self._stop_line()
        return line["phase"] if line is not None else None

    @property
    def stop_signal(self) -> str | None:
        """The signal its stop signal line names (SIGTERM, SIGINT), if it got one."""
        if self.sigterm is None:
            return None
        line = self._stop_line()
        return line["signal"] if line is not None else "SIGTERM"  # Lightning's: SIGTERM

    @property
    def stuck(self) -> dict[str, str] | None:
        """The fields of its STOP_SIGNAL_STUCK line (signal, idle, phase, step) and `doing`: what
        its main thread was stuck in (`collective: ...`, `data loading`, `code: ...`; absent
        from lines written before ae said it). None without such a line."""
        message = self.stuck_stop.message if self.stuck_stop is not None else ""
        if (m := STOP_SIGNAL_STUCK.parse(message)) is None:
            return None
        more = STUCK_MAIN_THREAD.parse(message)
        return {**m, **(more or {})}

    @property
    def marker_text(self) -> str:
        return f"{self.marker_name} {self.marker_edge}" if self.marker else ""


def _newer(current: float | None, candidate: float | None) -> bool:
    return candidate is not None and (current is None or candidate >= current)


class _Scanner:
    """Feeds the files of one rank, oldest first, into a RankLog."""

    def __init__(self, state: RankLog, max_shard_errors: int) -> None:
        self.s = state
        self.max_shard_errors = max_shard_errors
        self._stall_state: Stall | None = None

    def scan(self, log: LogBytes) -> None:
        s = self.s
        s.errors += log.count_level("ERROR") + log.count_level("CRITICAL")
        s.warnings += log.count_level("WARNING")
        if (start := log.last_record()) is not None:
            s.last = log.record(start)
            if s.last is not None and s.world_size is None:
                s.world_size = s.last.world
        self._last_state(log)
        self._stalls(log)
        s.crashes += read_crashes(log)
        self._once_per_run(log)

    @staticmethod
    def _last(log: LogBytes, prefix: str) -> Record | None:
        start = log.rfind_record(message_needle(prefix))
        return None if start is None else log.record(start)

    def _last_state(self, log: LogBytes) -> None:
        s = self.s
        if (rec := self._last(log, MARKER.prefix)) and (m := MARKER.parse(rec.message)):
            s.marker, s.marker_name, s.marker_edge = rec, m["name"], m["edge"]
            s.progress_time = max(s.progress_time or 0.0, rec.time)
            if epoch := EPOCH_MARKER_NAME.match(m["name"]):
                s.epoch = int(epoch["epoch"])
        for fmt in _STEP_LINES:
            rec = self._last(log, fmt.prefix)
            if rec and (m := fmt.parse(rec.message)) and _newer(s.step_time, rec.time):
                s.step, s.step_time = int(m["step"]), rec.time
        if rec := self._last(log, PREEMPTED.prefix):
            s.preempted = rec
        for fmt in (TRAIN_STEP, PROCESSED_TRAIN, VAL_STEP):
            if rec := self._last(log, fmt.prefix):
                s.progress_time = max(s.progress_time or 0.0, rec.time)
        start = log.rfind_record(b" rss=")
        if start is not None and (m := _MEMORY.search(log.text(start))):
            s.memory = m[0]
        if (rec := self._last(log, RANK_EXIT.prefix)) and (m := RANK_EXIT.parse(rec.message)):
            s.exit, s.exit_code = rec, int(m["code"])
        if rec := self._last(log, TRAINING_FINISHED.prefix):
            s.training_finished = rec
        for start in log.find_records(message_needle(CHECKPOINT_END.prefix)):
            rec = log.record(start)
            if rec is not None and (m := CHECKPOINT_END.parse(rec.message)) and saves_step_file(m):
                s.saved = rec
        if (start := log.last_level_record("ERROR")) is not None:
            s.last_error = log.evidence(start)
            more = log.continuation(start, ERROR_LINES)
            s.last_error_more = [log.evidence(p) for p in more]
        found = [p for n in _STOP_SIGNAL_NEEDLES if (p := log.rfind_record(n)) is not None]
        if found:
            s.sigterm = log.record(max(found))
        if (start := log.rfind_record(_STUCK_NEEDLE)) is not None:
            s.stuck_stop = log.record(start)
        if (pos := log.data.rfind(b"\n" + FAULTHANDLER_TIMEOUT)) >= 0:
            s.native_dump = log.evidence(pos + 1)
            s.native_dump_main = main_thread_frame(log, pos + 1)

    def _stalls(self, log: LogBytes) -> None:
        s = self.s
        hits = sorted(
            [(p, True) for p in log.find_records(message_needle(STALL.prefix))]
            + [(p, False) for p in log.find_records(message_needle(STALL_RESOLVED.prefix))]
        )
        for start, detected in hits:
            if not detected:
                # Leaving the stall for teardown (an exception or SIGTERM on its way out) is no
                # progress: the stall stays what the rank was doing.
                m = STALL_RESOLVED.parse(log.text(start))
                if m is None or not m["now"].startswith(_TEARDOWN):
                    s.resolved_stall = self._stall_state or s.resolved_stall
                    self._stall_state = None
                continue
            rec = log.record(start)
            m = None if rec is None else STALL.parse(rec.message)
            if rec is None or m is None:
                continue
            s.stall_reports += 1
            episode = (m["phase"], int(m["epoch"]), int(m["step"]))
            prev = self._stall_state
            if prev is not None and (prev.phase, prev.epoch, prev.step) == episode:
                continue  # a repeat of the same episode: keep its first report
            # A stop signal took the stalled rank to teardown, stuck on the same thing (a worker
            # it joins): no progress, so the stall stays what it was.
            if prev is not None and f"phase {episode[0]}" == _TEARDOWN and prev.step == episode[2]:
                continue
            evidence = [rec.evidence, *self._worker_frames(log, start)]
            self._stall_state = Stall(
                evidence, rec.time, m["phase"], int(m["epoch"]), int(m["step"]),
                float(m["idle"]), m["collective"],
            )  # fmt: skip
        s.open_stall = self._stall_state

    @staticmethod
    def _worker_frames(log: LogBytes, stall_start: int) -> list[Evidence]:
        """The busy workers' frames from the stall report after the STALL line at `stall_start`."""
        report = log.find_records(message_needle(STALL_REPORT.prefix), log.line_end(stall_start))
        start = next(report, None)
        return [] if start is None else busy_worker_frames(log, start)

    def _once_per_run(self, log: LogBytes) -> None:
        s = self.s
        if s.header_host is None:
            for start in log.find_records(message_needle(RANK_PROCESS.prefix)):
                rec = log.record(start)
                if rec is not None and (m := RANK_PROCESS.parse(rec.message)):
                    s.header_host = m["host"]
                    break
        if s.nonfinite is None:
            start = next(log.find_records(message_needle(NONFINITE.prefix)), None)
            s.nonfinite = None if start is None else log.record(start)
        if (last := self._last(log, NONFINITE.prefix)) is not None:
            s.nonfinite_last = last
        s.skipped_steps += sum(
            1 for _ in log.find_records(message_needle(NONFINITE_SKIPPED.prefix))
        )
        s.rollbacks += sum(1 for _ in log.find_records(message_needle(ROLLBACK.prefix)))
        for start in log.find_records(message_needle(LOSS_SPIKE.prefix)):
            if len(s.spikes) < SPIKES_KEPT and (rec := log.record(start)) is not None:
                s.spikes.append(rec)
        for start in log.find_records(message_needle(SHARD_PLAN.prefix)):
            rec = log.record(start)
            if rec is not None and (m := SHARD_PLAN.parse(rec.message)):
                s.shard_plans[m["split"]] = m
        for start in log.level_records("ERROR"):
            line = log.data[start : log.line_end(start)]
            if b"shard" not in line.lower() or _blames_no_shard(line):
                continue
            s.shard_error_lines += 1
            if len(s.shard_errors) < self.max_shard_errors and (rec := log.record(start)):
                s.shard_errors.append(rec)


def _blames_no_shard(line: bytes) -> bool:
    """A NONFINITE line of finite inputs (an injected fault, an LR too high, an overflow): it
    names the batch's shards, but a data error is a non-finite input (NONFINITE_INPUT)."""
    return message_needle(NONFINITE.prefix) in line and _NONFINITE_INPUT not in line


def read_rank(
    rank: int, files: list[Path], heartbeat: Heartbeat | None, max_shard_errors: int = 1000
) -> RankLog:
    """`files`: the rank's debug logs, oldest rotation first."""
    state = RankLog(rank, files, heartbeat=heartbeat)
    scanner = _Scanner(state, max_shard_errors)
    offset = 0.0
    for i, path in enumerate(files):
        log = LogBytes.read(path)
        if i == 0:  # the oldest file holds the header and the offset measured after it
            offset = clock_offset(log)
        log.clock_offset = offset
        scanner.scan(log)
    if heartbeat is not None and offset:
        heartbeat = state.heartbeat = replace(
            heartbeat, time=heartbeat.time - offset, last_progress=heartbeat.last_progress - offset
        )
    if heartbeat is not None:
        state.world_size = state.world_size or heartbeat.world_size
        if _newer(state.step_time, heartbeat.time):
            state.step = heartbeat.step
        if _newer(state.progress_time, heartbeat.last_progress):
            state.progress_time = heartbeat.last_progress
        if state.marker is None or _newer(state.marker.time, heartbeat.time):
            state.epoch = heartbeat.epoch
    return state


def clock_offset(log: LogBytes) -> float:
    """The rank's CLOCK_OFFSET against rank 0 (0 when it has none: one process, older runs)."""
    start = next(log.find_records(message_needle(CLOCK_OFFSET.prefix)), None)
    rec = None if start is None else log.record(start)
    m = CLOCK_OFFSET.parse(rec.message) if rec is not None else None
    return float(m["offset"]) if m else 0.0


def shard_of(rec: Record) -> str:
    """The shard an ERROR line names (its first `.tar` path or URL)."""
    m = _SHARD.search(rec.message)
    return m[1] if m else "?"
