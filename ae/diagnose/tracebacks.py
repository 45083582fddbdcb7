"""The tracebacks and faulthandler dumps in a rank's debug log: its crashes (an uncaught
exception's FATAL record, a fatal signal), a stalled rank's busy dataloader workers, the main
thread of the dump a starved watchdog's timer wrote. `ae.diagnose.rank_log` calls these.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from ae.diagnose.logscan import Evidence, LogBytes
from ae.diagnose.phases import phase_of_frames
from ae.log_lines import FATAL

# faulthandler's own output (not a record line): a fatal signal, and the dump of a native timer
# that fires when the watchdog thread cannot run (see logging_cfg.dump_stacks_later).
FAULTHANDLER_FATAL = b"Fatal Python error: "
FAULTHANDLER_TIMEOUT = b"Timeout ("
_SIGNALS = {
    "Segmentation fault": "SIGSEGV",
    "Aborted": "SIGABRT",
    "Bus error": "SIGBUS",
    "Floating-point exception": "SIGFPE",
    "Floating point exception": "SIGFPE",
    "Illegal instruction": "SIGILL",
}
# A traceback frame: loguru/traceback `File "x", line 3, in f`; faulthandler `File "x", line 3 in f`
_FRAME = re.compile(r'^[\s>]*File "(?P<path>[^"]+)", line (?P<line>\d+),? in (?P<func>\S+)')
# A worker's dump (faulthandler, SIGUSR1): its main thread is the "Current thread".
_WORKER_DUMP = "Current thread 0x"
_FETCHING = "utils/data/_utils/fetch.py"
# Unindented traceback lines that are not an exception (chained tracebacks have these between).
_NOT_EXCEPTION = ("Traceback", "During handling of", "The above exception")
TRACE_LIMIT = 20_000  # continuation lines read after a FATAL or a stall report
FRAMES_SHOWN = 3


@dataclass
class Crash:
    """An uncaught exception (FATAL line) or a fatal signal (faulthandler)."""

    evidence: list[Evidence]  # the line, the innermost frames, the exception line
    time: float
    kind: str  # exception type, or signal name
    where: str
    message: str
    phase: str | None
    signal: bool = False
    chain: list[str] = field(default_factory=list)  # every exception line of a chained traceback


def read_crashes(log: LogBytes) -> list[Crash]:
    """The log's FATAL records with their tracebacks, then its fatal signals."""
    crashes = []
    for start in log.level_records("CRITICAL"):
        rec = log.record(start)
        m = None if rec is None else FATAL.parse(rec.message)
        if rec is None or m is None:
            continue
        frames, chain = _trace(log, start)
        where = m["where"]
        phase = "data loading" if where.startswith("dataloader worker") else None
        phase = phase or phase_of_frames([(f[0], f[1]) for f in reversed(frames)])
        shown = [ev for *_, ev in frames[-FRAMES_SHOWN:]]
        crashes.append(
            Crash([rec.evidence, *shown, *chain[-1:]], rec.time, m["exc_type"], where,
                  m["message"], phase, chain=[e.text for e in chain])
        )  # fmt: skip
    pos = log.data.find(FAULTHANDLER_FATAL)
    while pos >= 0:
        if pos == 0 or log.data[pos - 1] == 0x0A:
            crashes.append(_fatal_signal(log, pos))
        pos = log.data.find(FAULTHANDLER_FATAL, pos + 1)
    return crashes


def _trace(log: LogBytes, start: int) -> tuple[list[tuple[str, str, Evidence]], list[Evidence]]:
    """Frames (outermost first) and exception lines (`Type: message`, one per exception of a
    chain, the last one raised last) of the traceback after a FATAL."""
    frames: list[tuple[str, str, Evidence]] = []
    chain: list[Evidence] = []
    for pos in log.continuation(start, TRACE_LIMIT):
        line = log.text(pos)
        if m := _FRAME.match(line):
            frames.append((m["path"], m["func"], log.evidence(pos)))
        elif line.strip() and not line[0].isspace() and not line.startswith(_NOT_EXCEPTION):
            chain.append(log.evidence(pos))
    return frames, chain


def _fatal_signal(log: LogBytes, pos: int) -> Crash:
    head = log.evidence(pos)
    name = head.text[len(FAULTHANDLER_FATAL) :].strip()
    frames: list[Evidence] = []
    current = False
    for p in log.continuation(pos, TRACE_LIMIT):
        line = log.text(p)
        if line.startswith("Current thread"):
            current = True
        elif current and _FRAME.match(line):
            frames.append(log.evidence(p))
        elif current and frames:
            break
    before = log.rfind_record(b" | ", pos)
    rec = None if before is None else log.record(before)
    when = rec.time if rec else 0.0
    parsed = [m for ev in frames if (m := _FRAME.match(ev.text))]
    phase = phase_of_frames([(m["path"], m["func"]) for m in parsed])
    signal = _SIGNALS.get(name, name)
    return Crash([head, *frames[:FRAMES_SHOWN]], when, signal, "process", name, phase, True)


def busy_worker_frames(log: LogBytes, report: int) -> list[Evidence]:
    """The innermost frame of each busy dataloader worker, from the faulthandler dumps that
    follow a stall report (the record at `report`): in a data loading stall the rank only waits
    on a queue, the worker shows where it is. A worker is busy when its main thread is fetching
    a batch; the idle ones wait for work in `_worker_loop` and are left out."""
    blocks: list[list[int]] = []
    for pos in log.continuation(report, TRACE_LIMIT):
        line = log.text(pos)
        if line.startswith(_WORKER_DUMP):
            blocks.append([])
        elif blocks and _FRAME.match(line) and ", in " not in line:
            blocks[-1].append(pos)
    busy = [b for b in blocks if any(_FETCHING in log.text(p) for p in b)]
    return [log.evidence(b[0]) for b in busy[:2]]


def main_thread_frame(log: LogBytes, dump: int) -> Evidence | None:
    """The innermost frame of the main thread in faulthandler's timer dump at `dump`. The dump
    lists threads newest first, so the main thread, the oldest, is the last block."""
    end = log.data.find(b"\n20", dump)  # the next log record ends the dump
    block = log.data.rfind(b"\nThread 0x", dump, end if end >= 0 else len(log.data))
    if block < 0:
        return None
    frame = log.data.find(b"\n  File ", block + 1)
    if frame < 0 or (end >= 0 and frame > end):
        return None
    return log.evidence(frame + 1)
