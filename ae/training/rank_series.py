"""Per-rank series next to the losses: each rank's own time per step, its data-wait share, its
straggler score and its memory, sent to the loggers by rank 0 at their cadence.

The figures are the ones every rank already writes into its heartbeat (`ae.forensics.heartbeat`:
`timing.recent`, `rss_mb`, its workers' RSS); rank 0 reads those files, so the series cost no
collective and no device sync (bench/rank_series_bench.py measures the read). The score is
`ae.stragglers.scores`, the detector's own rule. Multi-node runs whose logs folder is not
shared: rank 0 sees the heartbeats of its own node only, so the series cover those ranks.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import lightning as L

from ae.log_lines import GAN_STATS_FILE, HEARTBEAT_FILE
from ae.stragglers import RankTiming, scores
from ae.training.metrics import StepsDoneNumbering

# Series name -> what it is (the tag is `<series>/rank<N>`: TensorBoard groups each series).
SERIES = {
    "own_ms_per_step": "own time per step (data wait + compute, without waiting for peers), ms",
    "data_wait_pct": "share of the own time spent waiting for the next batch, %",
    "straggler_score": "own time per step over the other ranks' median (1 = as the others)",
    "rss_mb": "resident memory of the rank and its dataloader workers, MB",
}
# Heartbeats are rewritten every 1 to 5 s: reading them more often finds nothing new.
MIN_READ_INTERVAL_S = 1.0


def series_tag(series: str, rank: int) -> str:
    return f"{series}/rank{rank}"


def read_heartbeats(logs_dir: Path, run_ts: str) -> dict[int, dict[str, Any]]:
    """{rank: heartbeat record} of this run; a file being replaced or unreadable is skipped."""
    out = {}
    for path in Path(logs_dir).glob(HEARTBEAT_FILE.format(rank="*", ts=run_ts)):
        try:
            raw = json.loads(path.read_text())
            out[int(raw["rank"])] = raw
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return out


def rank_values(beats: dict[int, dict[str, Any]]) -> dict[str, float]:
    """The per-rank series of these heartbeats, as {tag: value}."""
    timings = {}
    for rank, raw in beats.items():
        try:
            timing = RankTiming.from_heartbeat(raw)
        except (KeyError, TypeError, ValueError):
            timing = None
        if timing is not None:
            timings[rank] = timing
    out: dict[str, float] = {}
    for rank, timing in sorted(timings.items()):
        if timing.recent is not None and timing.recent.steps > 0:
            out[series_tag("own_ms_per_step", rank)] = timing.recent.own_ms
            out[series_tag("data_wait_pct", rank)] = timing.recent.data_pct
    for rank, score in scores(timings).items():
        out[series_tag("straggler_score", rank)] = score
    for rank, raw in sorted(beats.items()):
        workers = raw.get("workers") or []
        rss = raw.get("rss_mb")
        if isinstance(rss, int | float):
            total = rss + sum(w.get("rss_mb") or 0 for w in workers if isinstance(w, dict))
            out[series_tag("rss_mb", rank)] = float(total)
    return out


def gan_values(logs_dir: Path, run_ts: str) -> dict[str, float]:
    """`gan/<name>/rank<N>`: each rank's latest discriminator stats, from its GAN_STATS_FILE
    (`ae.training.objective`: written on the cadence once the discriminator runs)."""
    out: dict[str, float] = {}
    for path in Path(logs_dir).glob(GAN_STATS_FILE.format(rank="*", ts=run_ts)):
        try:
            raw = json.loads(path.read_text())
            rank = int(raw.pop("rank"))
            raw.pop("step")
            out.update({series_tag(f"gan/{k}", rank): float(v) for k, v in raw.items()})
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return out


class RankSeries:
    """Rank 0 hands the per-rank series to the loggers after an optimizer step on the loggers'
    cadence (`StepBoundary` calls `after_step`), at most once per MIN_READ_INTERVAL_S."""

    def __init__(self, logs_dir: Path, run_ts: str) -> None:
        self.logs_dir, self.run_ts = Path(logs_dir), run_ts
        self._last_read = float("-inf")

    def after_step(self, trainer: L.Trainer, step: int) -> None:
        """After optimizer step `step` (`trainer.global_step`)."""
        if step % trainer.log_every_n_steps or not trainer.loggers or not trainer.is_global_zero:
            return
        now = time.monotonic()
        if now - self._last_read < MIN_READ_INTERVAL_S:
            return
        self._last_read = now
        values = rank_values(read_heartbeats(self.logs_dir, self.run_ts))
        values |= gan_values(self.logs_dir, self.run_ts)
        if values:
            for lg in trainer.loggers:
                if isinstance(lg, StepsDoneNumbering):  # with the losses, in one write
                    lg.add(values, step)
                else:
                    lg.log_metrics(values, step=step)
