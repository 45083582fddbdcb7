"""`ae-diagnose --watch`: `top` for the ranks of a job, from their heartbeat files.

Each rank's watchdog rewrites its heartbeat every few seconds, even while the rank is blocked, so
this view keeps moving when the job does not: a rank whose `idle s` (seconds since its last
progress) grows while the others' stay small is the one holding the job back; `hb age s` is its
heartbeat's age. Steps/s is measured between two heartbeats of a rank. `own ms` is a rank's own
time per step (data wait + compute, without waiting for its peers) over its recent window,
`score` that over the other ranks' median; a rank the detector named a straggler shows its cause
next to its score, in yellow. `main thread` says what each
rank's main thread is in (a collective and which, data loading, or the innermost frame of other
code), from its heartbeat; `verdict` marks the ranks the verdict (`ae.diagnose.verdict`, on the
logs as they are at that refresh) names as culprits, with their cause, in red. A rank whose
process is gone shows `dead` (with the signal or exit code torchrun saw) at the next refresh.
The view ends when every rank has ended (exited, failed, dead), after `count` refreshes, or on
Ctrl-C. On a console that is not a terminal (piped, captured), each refresh prints its table.
Narrow consoles (80 columns) keep rank, state, epoch, step, idle s and verdict whole: the other
columns are left out, least needed first, and long text wraps (`_fitting`).
"""

from __future__ import annotations

import time
from pathlib import Path

from rich.console import Console
from rich.live import Live
from rich.table import Table
from rich.text import Text

from ae.diagnose.evidence import read_run
from ae.diagnose.heartbeats import Heartbeat, read_heartbeat
from ae.diagnose.launcher_log import ProcessEnd
from ae.diagnose.log_files import DiagnoseError, list_runs
from ae.diagnose.verdict import Verdict, judge
from ae.stragglers import scores


class _Rates:
    """Steps/s per rank, from the last two heartbeats that differ in time."""

    def __init__(self) -> None:
        self._seen: dict[int, tuple[float, int]] = {}
        self.rates: dict[int, float] = {}

    def update(self, beat: Heartbeat) -> float | None:
        prev = self._seen.get(beat.rank)
        if prev is not None and beat.time > prev[0]:
            self.rates[beat.rank] = (beat.step - prev[1]) / (beat.time - prev[0])
        if prev is None or beat.time > prev[0]:
            self._seen[beat.rank] = (beat.time, beat.step)
        return self.rates.get(beat.rank)


def _ended(b: Heartbeat | None, ends: dict[int, ProcessEnd], rank: int) -> str | None:
    """How the rank ended (`exited`, `failed`, `dead: killed (SIGKILL)` ...), or None while it
    runs."""
    if (dead := ends.get(rank)) is not None:
        return f"dead: {dead.describe}"
    if b is None:
        return None
    if b.alive is False and b.state == "running":
        return "dead"
    return None if b.state == "running" else b.state


# The columns, in the order shown; `_DROPPED_FIRST` names those left out, in that order, when the
# console is too narrow for all (80 columns keeps rank, state, epoch, step, idle s and verdict).
_COLUMNS = ("rank", "host:pid", "state", "phase", "main thread", "epoch", "step", "steps/s",
            "idle s", "hb age s", "own ms", "score", "RSS", "stalled", "verdict")  # fmt: skip
_TEXT = ("host:pid", "state", "phase", "main thread", "verdict")
_DROPPED_FIRST = ("hb age s", "own ms", "host:pid", "RSS", "steps/s", "score", "stalled",
                  "main thread", "phase")  # fmt: skip
_SHRINKS = {"main thread": 14, "verdict": 16, "phase": 10}  # wrapped down to this, if needed
_MAX = {"main thread": 40}  # wider only where nothing else needs the room


def _width(cell: Text | str) -> int:
    return len(cell.plain if isinstance(cell, Text) else cell)


def _fitting(rows: list[list[Text | str]], width: int) -> dict[str, int]:
    """The columns that fit `width` characters and the width of each: every column as wide as
    its content, but the others dropped in `_DROPPED_FIRST` order and the long text ones
    (`_SHRINKS`) wrapped, until the table fits; what room is left widens the wrapped ones."""
    need = {
        name: min(max([len(name), *(_width(r[i]) for r in rows)]), _MAX.get(name, 1000))
        for i, name in enumerate(_COLUMNS)
    }
    least = {name: min(w, _SHRINKS.get(name, w)) for name, w in need.items()}
    shown = list(_COLUMNS)

    def room() -> int:  # each column: its width, a space either side, a border; one more border
        return width - sum(least[n] + 3 for n in shown) - 1

    for name in _DROPPED_FIRST:
        if room() >= 0:
            break
        shown.remove(name)
    widths = {name: least[name] for name in shown}
    left = room()
    for name in ("verdict", "main thread", "phase"):
        if name in widths and left > 0:
            more = min(left, need[name] - widths[name])
            widths[name] += more
            left -= more
    return widths


def watch_table(
    ts: str, beats: dict[int, Heartbeat | None], rates: _Rates, now: float,
    verdict: Verdict | None = None, ends: dict[int, ProcessEnd] | None = None,
    width: int = 250,
) -> Table:  # fmt: skip
    """The ranks' table, its columns fitted to `width` (the console's)."""
    world = max((b.world_size for b in beats.values() if b), default=0)
    score = scores({r: b.timing for r, b in beats.items() if b and b.timing})
    slow = {
        e["rank"]: e.get("cause", "?")
        for b in beats.values() if b is not None
        for e in b.stragglers if e.get("resolved") is None
    }  # fmt: skip
    blamed = {f.rank: f.cause for f in verdict.culprits} if verdict is not None else {}
    rows: list[list[Text | str]] = []
    for rank in sorted(set(beats) | set(range(world))):
        b = beats.get(rank)
        if b is None:
            rows.append([str(rank), "-", Text("no heartbeat", style="yellow"), *["-"] * 12])
            continue
        rate = rates.update(b)
        since = now - b.last_progress
        state = _ended(b, ends or {}, rank) or b.state
        state_style = "green" if state == "exited" else "" if state == "running" else "bold red"
        culprit = Text(f"CULPRIT: {blamed[rank]}", style="bold red") if rank in blamed else ""
        recent = b.timing.recent if b.timing else None
        own = "-" if recent is None else f"{recent.own_ms:.1f}"
        mark = Text("-" if rank not in score else f"{score[rank]:.1f}x")
        if rank in slow:
            mark = Text(f"{mark.plain} STRAGGLER {slow[rank]}", style="bold yellow")
        rows.append([
            Text(str(rank), style="bold red" if rank in blamed else ""), f"{b.host}:{b.pid}",
            Text(state, style=state_style), b.phase, b.main or "-", str(b.epoch), str(b.step),
            "-" if rate is None else f"{rate:.2f}",
            Text(f"{since:.0f}", style="bold red" if b.stalled else ""), f"{now - b.time:.0f}",
            own, mark, b.rss_text, Text("STALL", style="bold red") if b.stalled else "", culprit,
        ])  # fmt: skip
    widths = _fitting(rows, width)
    table = Table(title=f"ae-diagnose --watch  run {ts}  {time.strftime('%H:%M:%S')}")
    for name, w in widths.items():
        wraps = name in _SHRINKS
        table.add_column(
            name, justify="left" if name in _TEXT else "right", no_wrap=not wraps, width=w,
            overflow="fold" if wraps else "ellipsis",
        )  # fmt: skip
    for row in rows:
        table.add_row(*(row[_COLUMNS.index(name)] for name in widths))
    return table


def read_beats(logs_dir: Path, ts: str) -> dict[int, Heartbeat | None]:
    run = list_runs(logs_dir).get(ts)
    return {} if run is None else {r: read_heartbeat(p) for r, p in run.heartbeats.items()}


def _verdict(logs_dir: Path, ts: str) -> tuple[Verdict | None, dict[int, ProcessEnd]]:
    """The verdict on the logs as they are now, and how the ranks that ended did."""
    files = list_runs(logs_dir).get(ts)
    if files is None:
        return None, {}
    run = read_run(files)
    return judge(run), run.ends


def watch(logs_dir: Path, ts: str, console: Console, interval: float, count: int = 0) -> None:
    beats = read_beats(logs_dir, ts)
    if not beats:
        raise DiagnoseError(
            f"no heartbeat files for run {ts} in {logs_dir} (watchdog off: --stall_timeout=0?)"
        )
    rates = _Rates()
    frames = 0
    live = Live(console=console, auto_refresh=False) if console.is_terminal else None
    try:
        if live is not None:
            live.start()
        while True:
            verdict, ends = _verdict(logs_dir, ts)
            table = watch_table(ts, beats, rates, time.time(), verdict, ends, console.width)
            if live is not None:
                live.update(table, refresh=True)
            else:
                console.print(table)
            frames += 1
            over = all(
                b is not None and _ended(b, ends, rank) is not None
                for rank, b in beats.items()
            )  # fmt: skip
            if over or (count and frames >= count):
                return
            time.sleep(interval)
            beats = read_beats(logs_dir, ts)
    except KeyboardInterrupt:
        return
    finally:
        if live is not None:
            live.stop()
