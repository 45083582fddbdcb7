"""A run's ranks over wall time: what each did when (`ae-diagnose LOGS --timeline out.png`), and
the same events as a Chrome trace (`--trace`, `trace.py`).

Each rank's lane is cut into phases from its debug log: `setup` from its first line to its first
marker, then the marker pairs (`EPOCH e TRAINING START/END`: `step`, `VALIDATION`: `validation`,
`CHECKPOINT SAVE`: `checkpoint`, `SAMPLING`: `sampling`), and its STALL episodes over them, from
the moment it stopped progressing (the STALL line's time less its idle seconds) to its STALL
RESOLVED or its end: `data wait` (stalled in data loading: waiting for its workers), `waiting`
(blocked in a collective: waiting for a peer) or `stalled` (stuck in its own work); a victim of
the verdict with no report of its own waits from the culprit's stall on. A rank that
crashed or was killed is `dead` from its last line to the run's end. Beside each rank, the share
of its steps' own time spent waiting for data (its heartbeat's recent window). Marks: `STALL` (a
rank's first report of an episode), `STRAGGLER` (the detector's line, on the slow rank's lane),
`RESTART` (a new process header in a rank's log), `FATAL`, `KILLED`, `NONFINITE` and `SPIKE`
(a NONFINITE or LOSS SPIKE line, `ae.training.nonfinite`). The verdict's culprits get
their lane highlighted. Lines are found with the formats of `ae/log_lines/` (the writers'
own) and the byte search of `logscan.py`; times are corrected by each rank's clock offset.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

from ae.diagnose.evidence import read_run
from ae.diagnose.log_files import DiagnoseError, RunFiles
from ae.diagnose.logscan import LogBytes, Record, message_needle
from ae.diagnose.phases import marker_stage
from ae.diagnose.rank_log import clock_offset
from ae.diagnose.verdict import Verdict, judge
from ae.log_lines import (
    FATAL,
    LOSS_SPIKE,
    MARKER,
    NONFINITE,
    RANK_PROCESS,
    STALL,
    STALL_RESOLVED,
    STRAGGLER,
    STRAGGLER_RESOLVED,
)

# Phase -> colour, in legend order. Marker stage -> phase.
PHASES = {
    "setup": "#c7c7c7",
    "step": "#4c78a8",
    "data wait": "#f58518",
    "validation": "#54a24b",
    "checkpoint": "#9d6fb7",
    "sampling": "#e377c2",
    "waiting": "#eeca3b",
    "stalled": "#e45756",
    "dead": "#222222",
}
_STAGE_PHASE = {
    "TRAINING": "step",
    "VALIDATION": "validation",
    "CHECKPOINT SAVE": "checkpoint",
    "SAMPLING": "sampling",
}
# Verdict states of a rank whose process is gone (`exited`: gone too, but done: its lane ends).
_OVER = ("data wait", "waiting", "stalled", "dead")  # drawn over the phase they interrupt
_DEAD_STATES = ("crashed", "killed", "error exit", "peer failure", "stopped")
_TEARDOWN = "phase teardown"  # STALL RESOLVED `now`: a rank leaving for teardown, not progress


@dataclass(frozen=True)
class Span:
    rank: int
    phase: str
    start: float  # Unix seconds (rank 0's clock)
    end: float
    detail: str = ""


@dataclass(frozen=True)
class Mark:
    rank: int
    kind: str  # STALL, STRAGGLER, RESTART, FATAL, KILLED, NONFINITE, SPIKE
    time: float
    text: str


@dataclass
class Timeline:
    run: str
    ranks: list[int]
    start: float
    end: float
    spans: list[Span] = field(default_factory=list)
    marks: list[Mark] = field(default_factory=list)
    culprits: dict[int, str] = field(default_factory=dict)  # rank -> its cause
    # rank -> its share of own time spent waiting for data, over its heartbeat's recent window
    data_wait_pct: dict[int, float] = field(default_factory=dict)
    verdict: str = ""


_NEEDLES = {
    "marker": message_needle(MARKER.prefix),
    "stall": message_needle(STALL.prefix),
    "resolved": message_needle(STALL_RESOLVED.prefix),
    "process": message_needle(RANK_PROCESS.prefix),
    "fatal": message_needle(FATAL.prefix),
    "nonfinite": message_needle(NONFINITE.prefix),
    "spike": message_needle(LOSS_SPIKE.prefix),
}


def _records(log: LogBytes) -> list[tuple[int, str, Record]]:
    """(offset, kind, record) of the lines that move a lane, in file order."""
    found = []
    for kind, needle in _NEEDLES.items():
        for start in log.find_records(needle):
            if (rec := log.record(start)) is not None:
                found.append((start, kind, rec))
    return sorted(found, key=lambda f: f[0])


class _Lane:
    """One rank's phases, followed through its lines in order."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.spans: list[Span] = []
        self.marks: list[Mark] = []
        self.stack: list[str] = []  # open marker stages, innermost last
        self.phase: str = "setup"
        self.since: float | None = None  # when the current phase began
        self.first: float | None = None  # its first line
        self.stall: tuple[str, float, str] | None = None  # (phase, began, detail)
        self.last: float | None = None

    def _enter(self, phase: str, t: float) -> None:
        if self.since is not None and phase != self.phase and t > self.since:
            self.spans.append(Span(self.rank, self.phase, self.since, t))
        if phase != self.phase or self.since is None:
            self.phase, self.since = phase, t

    def _close_stall(self, t: float) -> None:
        if self.stall is None:
            return
        phase, began, detail = self.stall
        self.spans.append(Span(self.rank, phase, began, max(t, began), detail))
        self.stall = None

    def _base(self) -> str:
        return _STAGE_PHASE.get(self.stack[-1], "step") if self.stack else "step"

    def feed(self, kind: str, rec: Record) -> None:
        t = rec.time
        self.last = t if self.last is None else max(self.last, t)
        self.first = t if self.first is None else min(self.first, t)
        if kind == "process":
            if self.since is not None:  # a second process header: the rank started again
                self._close_stall(t)
                self.marks.append(Mark(self.rank, "RESTART", t, "new rank process"))
                self.stack = []
            self._enter("setup", t)
        elif kind == "marker" and (m := MARKER.parse(rec.message)):
            stage = marker_stage(m["name"])
            if stage not in _STAGE_PHASE:
                return
            if m["edge"] == "START":
                self.stack.append(stage)
            elif stage in self.stack:
                del self.stack[len(self.stack) - 1 - self.stack[::-1].index(stage)]
            if self.since is None:
                self.since = t  # a log without its header (rotated away)
            self._enter(self._base(), t)
        elif kind == "stall" and (m := STALL.parse(rec.message)):
            # Its last progress, but not before the phase it is in (nesting in the trace).
            began = max(t - float(m["idle"]), self.since or t)
            if self.stall is None:
                if m["collective"].startswith("yes"):
                    phase = "waiting"
                elif m["phase"] == "data loading":
                    phase = "data wait"
                else:
                    phase = "stalled"
                self.stall = (phase, began, f"{m['phase']}, step {m['step']}")
                self.marks.append(Mark(self.rank, "STALL", t, f"STALL {m['phase']}"))
        elif kind == "resolved" and (m := STALL_RESOLVED.parse(rec.message)):
            if not m["now"].startswith(_TEARDOWN):
                self._close_stall(t)
        elif kind == "fatal" and (m := FATAL.parse(rec.message)):
            self.marks.append(Mark(self.rank, "FATAL", t, f"FATAL {m['exc_type']}"))
        elif kind == "nonfinite" and (m := NONFINITE.parse(rec.message)):
            text = f"NONFINITE {m['value']} step {m['step']}"
            self.marks.append(Mark(self.rank, "NONFINITE", t, text))
        elif kind == "spike" and (m := LOSS_SPIKE.parse(rec.message)):
            self.marks.append(Mark(self.rank, "SPIKE", t, f"LOSS SPIKE step {m['step']}"))

    def finish(self, end: float) -> None:
        """Close the lane at `end` (its last line, or the run's end for a rank still open)."""
        if self.since is not None and end > self.since:
            self.spans.append(Span(self.rank, self.phase, self.since, end))
        self._close_stall(end)


def _victims_waiting(spans: list[Span], verdict: Verdict) -> list[Span]:
    """`waiting` spans for the verdict's victims that wrote no STALL report of their own (a
    culprit's --hang_timeout shorter than --stall_timeout ends the job first): from when the
    culprit stopped progressing (its stall's start), which the victims could not pass, to the
    victim's end."""
    stuck = [s.start for s in spans if s.phase in ("stalled", "data wait")
             and s.rank in {f.rank for f in verdict.culprits}]  # fmt: skip
    if not stuck:
        return []
    since, culprits = min(stuck), ", ".join(str(f.rank) for f in verdict.culprits)
    out = []
    for v in verdict.victims:
        own = [s for s in spans if s.rank == v.rank and s.phase != "dead"]
        if not own or any(s.phase in _OVER for s in own):
            continue  # its own report says how it waited
        end = max(s.end for s in own)  # its last line, or the run's end while it is there
        if end > since:
            detail = f"waiting for rank {culprits} (the verdict; no STALL report of its own)"
            out.append(Span(v.rank, "waiting", since, end, detail))
    return out


def _train_log_marks(paths: list[Path]) -> list[Mark]:
    """STRAGGLER lines (rank 0's detector, in the train log), on the slow rank's lane."""
    marks = []
    for path in paths:
        log = LogBytes.read(path)
        for start in log.find_records(f"] {STRAGGLER.prefix.split()[0]} ".encode()):
            rec = log.record(start)
            if rec is not None and (m := STRAGGLER.parse(rec.message)):
                text = f"STRAGGLER {float(m['score']):.1f}x {m['cause']}"
                marks.append(Mark(int(m["rank"]), "STRAGGLER", rec.time, text))
            elif rec is not None and (m := STRAGGLER_RESOLVED.parse(rec.message)):
                marks.append(Mark(int(m["rank"]), "STRAGGLER", rec.time, "STRAGGLER resolved"))
    return marks


def build_timeline(files: RunFiles) -> Timeline:
    """Every rank's phases and marks, and the verdict's culprits, of the run `files`."""
    run = read_run(files)
    verdict = judge(run)
    lanes: dict[int, _Lane] = {}
    for rank, paths in sorted(files.debug_logs.items()):
        lane = lanes[rank] = _Lane(rank)
        offset = 0.0
        for i, path in enumerate(paths):
            log = LogBytes.read(path)
            if i == 0:
                offset = clock_offset(log)
            log.clock_offset = offset
            for _, kind, rec in _records(log):
                lane.feed(kind, rec)
            if (last := log.last_record()) is not None and (rec := log.record(last)):
                lane.last = rec.time if lane.last is None else max(lane.last, rec.time)
    starts = [lane.first for lane in lanes.values() if lane.first is not None]
    ends = [t for t in (run.reference, *(lane.last for lane in lanes.values())) if t]
    if not starts or not ends:
        raise DiagnoseError(f"run {files.ts}: no debug_rank<N>_<TS>.log lines to draw a timeline")
    start, end = min(starts), max(ends)
    tl = Timeline(files.ts, sorted(set(lanes) | set(run.ranks)), start, end)
    for rank, lane in lanes.items():
        state = verdict.states.get(rank, "")
        gone = state in _DEAD_STATES or state == "exited"
        lane_end = lane.last if gone and lane.last is not None else end
        lane.finish(lane_end)
        if state in _DEAD_STATES and lane_end < end:
            lane.spans.append(Span(rank, "dead", lane_end, end, state))
        if state == "killed":
            lane.marks.append(Mark(rank, "KILLED", lane_end, "KILLED"))
        tl.spans += lane.spans
        tl.marks += lane.marks
    tl.spans += _victims_waiting(tl.spans, verdict)
    tl.marks += [m for m in _train_log_marks(files.train_logs) if m.rank in lanes]
    tl.culprits = {f.rank: f.cause for f in verdict.culprits}
    for rank, r in run.ranks.items():
        window = r.heartbeat.timing.recent if r.heartbeat and r.heartbeat.timing else None
        if window is not None and window.steps > 0:
            tl.data_wait_pct[rank] = window.data_pct
    if verdict.culprits:
        tl.verdict = "held back by " + ", ".join(
            f"rank {f.rank}: {f.cause}" for f in verdict.culprits
        )
    else:
        tl.verdict = verdict.status
    return tl


# --- the picture ------------------------------------------------------------------------------
_MARK_STYLE = {  # kind -> (marker, colour)
    "STALL": ("v", "#b30000"),
    "STRAGGLER": ("^", "#d35400"),
    "RESTART": ("D", "#1f4e79"),
    "FATAL": ("X", "#000000"),
    "NONFINITE": ("*", "#b30000"),
    "SPIKE": ("P", "#d35400"),
    "KILLED": ("X", "#000000"),
}


def draw_timeline(tl: Timeline, path: Path) -> None:
    """The PNG: one lane per rank (rank 0 on top) over seconds since the run's first line."""
    # matplotlib only here: ae-diagnose without --timeline starts without it.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch
    from matplotlib.ticker import MaxNLocator

    lanes = len(tl.ranks)
    fig = Figure(figsize=(11, 1.6 + 0.55 * lanes), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    row = {rank: i for i, rank in enumerate(tl.ranks)}
    for rank in tl.culprits:
        if rank in row:  # the culprit's lane: a red band behind it
            ax.axhspan(row[rank] - 0.5, row[rank] + 0.5, color="#fde0dd", zorder=0)
    for s in sorted(tl.spans, key=lambda s: s.phase in _OVER):  # stalls over their phase
        ax.broken_barh([(s.start - tl.start, s.end - s.start)], (row[s.rank] - 0.35, 0.7),
                       facecolors=PHASES[s.phase], edgecolor="none", zorder=2)  # fmt: skip
    seen: set[str] = set()
    for m in sorted(tl.marks, key=lambda m: m.time):
        marker, colour = _MARK_STYLE[m.kind]
        x, y = m.time - tl.start, row[m.rank] - 0.42
        ax.plot([x], [y], marker=marker, color=colour, markersize=9, zorder=4, clip_on=False)
        key = f"{m.rank}:{m.kind}"
        if key not in seen:  # the first of each kind per lane carries its words
            seen.add(key)
            right = x > 0.75 * (tl.end - tl.start)  # words to the left near the right edge
            ax.annotate(m.text, (x, y), xytext=(-4 if right else 4, 6), textcoords="offset points",
                        ha="right" if right else "left", fontsize=8, color=colour,
                        fontweight="bold", zorder=5)  # fmt: skip
    labels = []
    for rank in tl.ranks:
        lines = [f"rank {rank}"]
        if (cause := tl.culprits.get(rank)) is not None:
            lines.append(f"culprit: {cause}")
        if (pct := tl.data_wait_pct.get(rank)) is not None:  # the steps' own data wait
            lines.append(f"data wait {pct:.0f}%")
        labels.append("\n".join(lines))
    ax.set_yticks(range(lanes), labels)
    for tick, rank in zip(ax.get_yticklabels(), tl.ranks, strict=True):
        if rank in tl.culprits:
            tick.set_color("#b30000")
            tick.set_fontweight("bold")
    ax.set_ylim(lanes - 0.5, -0.8)  # rank 0 on top; room above it for the marks' words
    ax.set_xlim(0, max(tl.end - tl.start, 1e-3))
    ax.xaxis.set_major_locator(MaxNLocator(nbins=12, min_n_ticks=4))
    start = datetime.fromtimestamp(tl.start).strftime("%Y-%m-%d %H:%M:%S")
    ax.set_xlabel(f"seconds since the run's first line ({start})")
    ax.grid(True, axis="x", alpha=0.3, zorder=0)
    ax.set_title(f"Run {tl.run}: {tl.verdict}", loc="left", fontsize=11)
    used = [p for p in PHASES if any(s.phase == p for s in tl.spans)]
    handles = [Patch(color=PHASES[p], label=p) for p in used]
    fig.legend(handles=handles, loc="outside lower center", ncol=len(handles), fontsize=9,
               frameon=False)  # fmt: skip
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, format="png")
