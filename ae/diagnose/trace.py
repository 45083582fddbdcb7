"""The timeline's events as a Chrome trace (`ae-diagnose LOGS --trace trace.json`): open it in
Perfetto (ui.perfetto.dev) or chrome://tracing, one thread per rank.

Trace-event format: a JSON object with `traceEvents`; each phase span a complete event (`ph:
X`, `ts` and `dur` in microseconds since the run's first line), each mark an instant event
(`ph: i`, scope thread), and metadata events naming the process (the run) and each thread
(`rank N`, the culprit's with its cause). `otherData` carries the run, its start time and the
verdict.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ae import atomic_files
from ae.diagnose.timeline import Timeline

PID = 1  # one process in the trace: the run


def _us(seconds: float) -> int:
    return round(seconds * 1e6)


def trace_events(tl: Timeline) -> dict[str, Any]:
    events: list[dict[str, Any]] = [
        {"ph": "M", "name": "process_name", "pid": PID, "args": {"name": f"ae run {tl.run}"}}
    ]
    for rank in tl.ranks:
        cause = tl.culprits.get(rank)
        name = f"rank {rank} (culprit: {cause})" if cause else f"rank {rank}"
        events.append({"ph": "M", "name": "thread_name", "pid": PID, "tid": rank,
                       "args": {"name": name}})  # fmt: skip
        events.append({"ph": "M", "name": "thread_sort_index", "pid": PID, "tid": rank,
                       "args": {"sort_index": rank}})  # fmt: skip
    for s in sorted(tl.spans, key=lambda s: (s.rank, s.start)):
        event = {"ph": "X", "name": s.phase, "cat": "phase", "pid": PID, "tid": s.rank,
                 "ts": _us(s.start - tl.start), "dur": max(_us(s.end - s.start), 1)}  # fmt: skip
        if s.detail:
            event["args"] = {"detail": s.detail}
        events.append(event)
    for m in sorted(tl.marks, key=lambda m: m.time):
        events.append({"ph": "i", "s": "t", "name": m.kind, "cat": "mark", "pid": PID,
                       "tid": m.rank, "ts": _us(m.time - tl.start),
                       "args": {"text": m.text}})  # fmt: skip
    return {
        "traceEvents": events,
        "displayTimeUnit": "ms",
        "otherData": {"run": tl.run, "start_unix_s": tl.start, "verdict": tl.verdict},
    }


def write_trace(tl: Timeline, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_files.write(path, (json.dumps(trace_events(tl), indent=None) + "\n").encode())
