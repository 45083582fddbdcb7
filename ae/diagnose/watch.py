"""`ae-diagnose --watch`: `top` for the ranks of a job, from their heartbeat files.

Each rank's watchdog rewrites its heartbeat every few seconds, even while the rank is blocked, so
this view keeps moving when the job does not: a rank whose `since progress` grows while the
others' stay small is the one holding the job back. Steps/s is measured between two heartbeats
of a rank. `own ms` is a rank's own time per step (data wait + compute, without waiting for its
peers) over its recent window, `score` that over the other ranks' median; a rank the detector
named a straggler shows its cause next to its score, in yellow. The view ends when every rank has
exited (or after `count` refreshes, or Ctrl-C).
"""

from __future__ import annotations

import time
from pathlib import Path

from rich.console import Console
from rich.live import Live
from rich.table import Table
from rich.text import Text

from ae.diagnose.heartbeats import Heartbeat, read_heartbeat
from ae.diagnose.run_files import DiagnoseError, list_runs
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


def watch_table(ts: str, beats: dict[int, Heartbeat | None], rates: _Rates, now: float) -> Table:
    world = max((b.world_size for b in beats.values() if b), default=0)
    score = scores({r: b.timing for r, b in beats.items() if b and b.timing})
    slow = {
        e["rank"]: e.get("cause", "?")
        for b in beats.values() if b is not None
        for e in b.stragglers if e.get("resolved") is None
    }  # fmt: skip
    table = Table(title=f"ae-diagnose --watch  run {ts}  {time.strftime('%H:%M:%S')}")
    for name in ("rank", "host:pid", "state", "phase", "epoch", "step", "steps/s",
                 "since progress s", "heartbeat age s", "own ms", "score", "RSS",
                 "stalled"):  # fmt: skip
        text = name in ("host:pid", "state", "phase")
        table.add_column(name, justify="left" if text else "right", no_wrap=True)
    for rank in sorted(set(beats) | set(range(world))):
        b = beats.get(rank)
        if b is None:
            table.add_row(str(rank), "-", Text("no heartbeat", style="yellow"), *["-"] * 10)
            continue
        rate = rates.update(b)
        since = now - b.last_progress
        state_style = "green" if b.state == "exited" else "red" if b.state == "failed" else ""
        recent = b.timing.recent if b.timing else None
        own = "-" if recent is None else f"{recent.own_ms:.1f}"
        mark = Text("-" if rank not in score else f"{score[rank]:.1f}x")
        if rank in slow:
            mark = Text(f"{mark.plain} STRAGGLER {slow[rank]}", style="bold yellow")
        table.add_row(
            str(rank), f"{b.host}:{b.pid}", Text(b.state, style=state_style), b.phase,
            str(b.epoch), str(b.step), "-" if rate is None else f"{rate:.2f}",
            Text(f"{since:.0f}", style="bold red" if b.stalled else ""), f"{now - b.time:.0f}",
            own, mark, b.rss_text, Text("STALL", style="bold red") if b.stalled else "",
        )  # fmt: skip
    return table


def read_beats(logs_dir: Path, ts: str) -> dict[int, Heartbeat | None]:
    run = list_runs(logs_dir).get(ts)
    return {} if run is None else {r: read_heartbeat(p) for r, p in run.heartbeats.items()}


def watch(logs_dir: Path, ts: str, console: Console, interval: float, count: int = 0) -> None:
    beats = read_beats(logs_dir, ts)
    if not beats:
        raise DiagnoseError(
            f"no heartbeat files for run {ts} in {logs_dir} (watchdog off: --stall_timeout=0?)"
        )
    rates = _Rates()
    frames = 0
    try:
        with Live(console=console, auto_refresh=False) as live:
            while True:
                live.update(watch_table(ts, beats, rates, time.time()), refresh=True)
                frames += 1
                over = all(b is not None and b.state != "running" for b in beats.values())
                if over or (count and frames >= count):
                    return
                time.sleep(interval)
                beats = read_beats(logs_dir, ts)
    except KeyboardInterrupt:
        return
