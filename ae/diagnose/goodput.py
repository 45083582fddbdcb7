"""Reader: what a job's failures cost, from the logs of all its attempts (`ae-diagnose
--goodput`, `goodput` in `--json`, and the launcher's GOODPUT line at the end of a job that
restarted).

The job's wall time, from the first record of its first attempt to the last record of its last
(in any of their train and debug logs), is cut into parts that add up to it:

- startup: the first attempt, from its first record to its first `TRAINING START` marker;
- restart: from the end of a failed attempt (its last record: every rank gone, the moment the
  verdict is taken; on several nodes the next rendezvous round comes first) to the next
  attempt's first `TRAINING START`: the judgment, the rendezvous, the processes' start, the
  checkpoint's load;
- detection: from a failure to the end of that attempt: the watchdog's `--hang_timeout`, a
  collective's `--pg_timeout`, the teardown. The failure is where the ranks that did not tear
  down stopped (a killed or hung rank: its heartbeat's `last_progress` or its newest progress
  line, whichever is later), or else the first ERROR record of the attempt, or else (every rank
  torn down without one: a stop, of a hang too) the ranks' newest progress line;
- checkpoint, validation: rank 0's `CHECKPOINT SAVE` and `EPOCH e VALIDATION` markers, START to
  END, from the first step to the failure (or the end of training);
- recompute: the training time of a failed attempt after the checkpoint the next attempt resumed
  from (its steps were trained again);
- data wait: of the rest of the training time, what the attempt's ranks waited for batches (the
  largest `timing.run.data_s` of its ranks' last heartbeats: a rank waiting for data holds every
  rank back), spread evenly, so recompute keeps its own;
- training: the rest of the training time: from the first `TRAINING START` to the end of
  training (`Training finished`) or the failure, less the saves, validation and sampling in it
  (the epoch boundaries between the markers included): the effective training time;
- other: what no part above holds: sampling, the last attempt's end after its training (plots,
  teardown), an attempt's end after a stop.

Rank 0's log places the markers (the lowest rank with a log where rank 0 has none); the ranks
step together. Times are each record's own (the clocks of several hosts are taken as one).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from rich.console import Console

from ae.diagnose.job_chain import job_chain, restart_lines
from ae.diagnose.log_files import RunFiles, list_runs
from ae.log_lines import (
    CHANGE_OF_NODES,
    CHECKPOINT_END,
    EPOCH_MARKER_NAME,
    FAULT_INJECTED,
    GOODPUT,
    MARKER,
    PROCESSED_TRAIN,
    RECORD_PATTERN,
    RESTART,
    TRAIN_STEP,
    TRAINING_FINISHED,
    VAL_STEP,
    saves_step_file,
)

PARTS = ("training", "data_wait", "checkpoint", "validation", "recompute", "detection",
         "restart", "startup", "other")  # fmt: skip
LOST = ("recompute", "detection", "restart")  # what the console line names first
TAIL_BYTES = 64 * 1024  # a log's last record is among its last bytes
PROGRESS_LINES = (MARKER, TRAIN_STEP, PROCESSED_TRAIN, VAL_STEP, FAULT_INJECTED)


def record_time(text: str) -> float:
    """A record's `2026-11-23 09:45:18.873` as Unix seconds (the writer's local time)."""
    return datetime.strptime(text, "%Y-%m-%d %H:%M:%S.%f").timestamp()


def _first_record(path: Path) -> float | None:
    with open(path, errors="replace") as f:
        for line in f:
            if m := RECORD_PATTERN.match(line):
                return record_time(m["time"])
    return None


def _last_record(path: Path) -> float | None:
    with open(path, "rb") as f:
        f.seek(0, 2)
        f.seek(max(0, f.tell() - TAIL_BYTES))
        lines = f.read().decode(errors="replace").splitlines()
    for line in reversed(lines):
        if m := RECORD_PATTERN.match(line):
            return record_time(m["time"])
    return None


@dataclass
class Attempt:
    """One attempt's times, from its logs (Unix seconds)."""

    ts: str
    start: float
    end: float
    first_step: float | None = None  # its first TRAINING START marker
    finished: float | None = None  # `Training finished`
    progress: float | None = None  # the last progress of any rank (heartbeats)
    busy: list[tuple[str, float, float]] = field(default_factory=list)  # (part, from, to)
    saved: dict[int, float] = field(default_factory=dict)  # step -> its CHECKPOINT SAVE END
    data_s: float = 0.0


def _marker_part(name: str) -> str | None:
    if m := EPOCH_MARKER_NAME.fullmatch(name):
        return "training" if m["stage"] == "TRAINING" else "validation"
    return {"CHECKPOINT SAVE": "checkpoint", "SAMPLING": "other"}.get(name)


def _read_markers(attempt: Attempt, files: list[Path]) -> None:
    """Rank 0's markers: the first step, the busy intervals, the saves, the end of training."""
    opened: dict[str, float] = {}
    for path in files:
        with open(path, errors="replace") as f:
            for line in f:
                if "==========" not in line and TRAINING_FINISHED.prefix not in line:
                    continue
                if (rec := RECORD_PATTERN.match(line)) is None:
                    continue
                t, message = record_time(rec["time"]), rec["message"]
                if TRAINING_FINISHED.parse(message) is not None:
                    attempt.finished = t
                elif (m := MARKER.parse(message)) and (part := _marker_part(m["name"])):
                    if part == "training":
                        if attempt.first_step is None and m["edge"] == "START":
                            attempt.first_step = t
                    elif m["edge"] == "START":
                        opened[part] = t
                    elif part in opened:
                        attempt.busy.append((part, opened.pop(part), t))
                    saved = CHECKPOINT_END.parse(message)
                    if saved is not None and saves_step_file(saved):  # a point to resume from
                        attempt.saved[int(saved["step"])] = t
    attempt.busy += [(part, t, attempt.end) for part, t in opened.items()]  # never closed


def read_attempt(run: RunFiles) -> Attempt | None:
    """The times of one attempt, or None for a run without a record."""
    logs = [*run.train_logs, *(p for r in sorted(run.debug_logs) for p in run.debug_logs[r])]
    firsts = [t for p in logs if (t := _first_record(p)) is not None]
    lasts = [t for p in logs if (t := _last_record(p)) is not None]
    if not firsts:
        return None
    attempt = Attempt(run.ts, min(firsts), max(lasts))
    if run.debug_logs:
        _read_markers(attempt, run.debug_logs[0 if 0 in run.debug_logs else min(run.debug_logs)])
    beats = []
    for path in run.heartbeats.values():
        try:
            beats.append(json.loads(path.read_text()))
        except (OSError, ValueError):
            continue
    # A rank that tore down beat on its way out: the failure is where the others stopped (a
    # killed rank, a hung one: its last beat or progress line), or else the first error any
    # rank wrote (the train log has them all).
    stuck = [max(b["last_progress"], _last_progress(run.debug_logs.get(b["rank"], [])))
             for b in beats if b.get("last_progress") and b.get("phase") != "teardown"]  # fmt: skip
    attempt.progress = max(stuck) if stuck else _first_error(run.train_logs)
    if attempt.progress is None and beats:
        # Every rank tore down without an error (a stop, also of a hang): where they last
        # progressed; the stall before the stop is no training.
        attempt.progress = max(map(_last_progress, run.debug_logs.values()), default=0.0) or None
    runs = [((b.get("timing") or {}).get("run") or {}).get("data_s", 0.0) for b in beats]
    attempt.data_s = max(runs, default=0.0)
    return attempt


def _last_progress(files: list[Path]) -> float:
    """The newest progress line of a rank's log (a marker, a step line, an injected fault), from
    its tail; 0 without one. Not the watchdog's STALL lines, which come after the last step."""
    for path in reversed(files):
        with open(path, "rb") as f:
            f.seek(0, 2)
            f.seek(max(0, f.tell() - TAIL_BYTES))
            lines = f.read().decode(errors="replace").splitlines()
        for line in reversed(lines):
            m = RECORD_PATTERN.match(line)
            if m and any(fmt.parse(m["message"]) for fmt in PROGRESS_LINES):
                return record_time(m["time"])
    return 0.0


def _first_error(files: list[Path]) -> float | None:
    for path in files:
        with open(path, errors="replace") as f:
            for line in f:
                if (m := RECORD_PATTERN.match(line)) and m["level"] in ("ERROR", "CRITICAL"):
                    return record_time(m["time"])
    return None


def _overlap(a: float, b: float, lo: float, hi: float) -> float:
    return max(0.0, min(b, hi) - max(a, lo))


def split(attempts: list[Attempt], resumes: list[int | None], failed: list[bool]) -> dict:
    """The parts of the job's wall time. `resumes[i]`: the step attempt i+1 resumed from (its
    RESTART line), None after the last; `failed[i]`: attempt i ended in a failure."""
    parts = dict.fromkeys(PARTS, 0.0)
    begin = attempts[0].start
    edge = begin  # where the previous attempt's time ended
    for i, a in enumerate(attempts):
        start = max(a.start, edge)
        end = max(a.end, start)
        first = min(max(a.first_step, start), end) if a.first_step is not None else end
        # between two attempts, and the next one's start up to its first step: the restart
        parts["startup" if i == 0 else "restart"] += first - edge
        if a.finished is not None:
            cut = a.finished
        elif a.progress is not None:  # a failure, or a stop: where the ranks stopped
            cut = a.progress
        else:
            cut = end
        cut = min(max(cut, first), end)
        parts["detection" if failed[i] and a.finished is None else "other"] += end - cut
        busy = {p: sum(_overlap(f, t, first, cut) for q, f, t in a.busy if q == p)
                for p in ("checkpoint", "validation", "other")}  # fmt: skip
        for p, seconds in busy.items():
            parts[p] += seconds
        trained = (cut - first) - sum(busy.values())
        redone = 0.0
        if i < len(resumes) and (step := resumes[i]) is not None and failed[i]:
            since = min(max(a.saved.get(step, first), first), cut)
            redone = (cut - since) - sum(_overlap(f, t, since, cut) for _, f, t in a.busy)
        parts["recompute"] += redone
        kept = trained - redone
        wait = min(a.data_s, trained) * (kept / trained) if trained > 0 else 0.0
        parts["data_wait"] += wait
        parts["training"] += kept - wait
        edge = end
    wall = edge - begin
    return {
        "wall_s": round(wall, 3),
        "effective_share": round(parts["training"] / wall, 4) if wall > 0 else 0.0,
        "parts": {p: round(s, 3) for p, s in parts.items()},
        "attempts": len(attempts),
        "runs": [a.ts for a in attempts],
    }


def job_goodput(files: RunFiles, last_failed: bool) -> dict[str, Any] | None:
    """`goodput` of the job that run `files` belongs to (all its attempts), or None when no
    attempt wrote a record. `last_failed`: the last attempt ended in a failure."""
    runs = list_runs(files.logs_dir)
    lines = restart_lines(runs)
    chain = job_chain(files.ts, runs, lines)
    found = [(ts, a) for ts in chain if ts in runs and (a := read_attempt(runs[ts])) is not None]
    if not found:
        return None
    resumes: list[int | None] = []
    failed: list[bool] = []
    for ts, _ in found[:-1]:
        nxt = chain[chain.index(ts) + 1]
        parsed = RESTART.parse(lines.get(nxt, ""))
        resumes.append(int(parsed["resume"]) if parsed else None)
        failed.append(parsed is not None and parsed["failed"] != CHANGE_OF_NODES)
    return split([a for _, a in found], resumes, [*failed, last_failed])


def goodput_line(doc: dict[str, Any]) -> str:
    """The GOODPUT line of `goodput`: the effective share, then where the rest went, largest
    first."""
    parts = doc["parts"]
    rest = sorted((p for p in PARTS if p != "training" and parts[p] > 0),
                  key=lambda p: (p not in LOST, -parts[p]))  # fmt: skip
    return GOODPUT.format(
        share=f"{100 * doc['effective_share']:.1f}", training=f"{parts['training']:.1f}",
        wall=f"{doc['wall_s']:.1f}", attempts=doc["attempts"],
        parts=", ".join(f"{p.replace('_', ' ')} {parts[p]:.1f}s" for p in rest) or "nothing",
    )  # fmt: skip


def render_goodput(doc: dict[str, Any] | None, console: Console) -> None:
    """`ae-diagnose --goodput`: the GOODPUT line, then each part with its share of the wall."""
    if doc is None:
        console.print("Goodput: no attempt of this job wrote a record")
        return
    console.print(goodput_line(doc))
    console.print(f"  runs: {', '.join(doc['runs'])}")
    wall = doc["wall_s"]
    for part in PARTS:
        seconds = doc["parts"][part]
        share = 100 * seconds / wall if wall > 0 else 0.0
        console.print(f"  {part.replace('_', ' '):<11} {seconds:>10.1f}s {share:>6.1f}%")
    console.print(f"  {'wall':<11} {wall:>10.1f}s")
