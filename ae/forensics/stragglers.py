"""Writer: straggler detection while the job runs, without a collective (rank 0 reads the
heartbeats) and its STRAGGLER lines; `ae.diagnose.stragglers` reads them.

Every rank's heartbeat carries its step times (`ae.forensics.step_times`) and its dataloader
workers' read rates. Rank 0's watchdog thread reads the heartbeat files of all ranks each time it
writes its own, scores them (`ae.stragglers`: own time per step / the other ranks' median), and
when a rank stays above `--straggler_factor` for `--straggler_window` seconds it logs one
`STRAGGLER` WARNING (train log, console, its debug log) naming the rank, its score, the cause
and the evidence; `STRAGGLER RESOLVED` once its score stays at or below the factor for the
window too (a dip of a few seconds, from a busy neighbour or a checkpoint, neither names nor
clears a rank). The episodes go into rank 0's heartbeat (`stragglers`), where every rank looks
for its own name and copies the line into its own debug log, so `grep STRAGGLER
debug_rank1_*.log` finds it too.

Multi-node: where the logs folder is shared, rank 0 judges every rank. Where each node has a
folder of its own (rank 0's heartbeat is not there), each node's local rank 0 judges the ranks of
its node, and those ranks look for their names in its heartbeat.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from loguru import logger

from ae.log_lines import HEARTBEAT_FILE, STRAGGLER, STRAGGLER_RESOLVED, main_log
from ae.stragglers import RankTiming, judge, scores
from logging_cfg import RankContext

EPISODES_KEPT = 20  # resolved episodes kept in the heartbeat (the open ones always are)


def read_timings(
    logs_dir: Path, run_ts: str, now: float, max_age_s: float
) -> dict[int, RankTiming]:
    """The step times of the running ranks whose heartbeat is at most `max_age_s` old."""
    out = {}
    for path in logs_dir.glob(HEARTBEAT_FILE.format(rank="*", ts=run_ts)):
        try:
            raw = json.loads(path.read_text())
            if raw.get("state") != "running" or now - float(raw["time"]) > max_age_s:
                continue
            timing = RankTiming.from_heartbeat(raw)
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            continue  # gone, or written by an older version
        if timing is not None:
            out[timing.rank] = timing
    return out


class Stragglers:
    """Runs in the watchdog thread of every rank: the detecting rank judges, the others follow
    the detecting rank's heartbeat for episodes that name them."""

    def __init__(
        self, factor: float, window_s: float, logs_dir: Path, run_ts: str, ctx: RankContext,
        max_age_s: float,
    ) -> None:  # fmt: skip
        self.factor, self.window_s = factor, window_s
        self.logs_dir, self.run_ts, self.ctx = Path(logs_dir), run_ts, ctx
        self.max_age_s = max_age_s
        self.episodes: list[dict[str, Any]] = []  # published in the heartbeat when detecting
        self._above: dict[int, float] = {}  # rank -> since when it is above the factor
        self._below: dict[int, float] = {}  # rank -> since when it is at or below it
        self._open: dict[int, dict[str, Any]] = {}
        self._told: set[tuple[float, bool]] = set()  # (since, resolved) lines copied

    def _heartbeat(self, rank: int) -> Path:
        return self.logs_dir / HEARTBEAT_FILE.format(rank=rank, ts=self.run_ts)

    def detector_rank(self) -> int:
        """Rank 0 where its heartbeat is visible, else this node's local rank 0."""
        if self.ctx.rank == 0 or self._heartbeat(0).exists():
            return 0
        return self.ctx.rank - self.ctx.local_rank

    def check(self, now: float | None = None) -> None:
        now = time.time() if now is None else now
        if self.detector_rank() == self.ctx.rank:
            self._detect(now)
        else:
            self._follow()

    # --- the detecting rank -----------------------------------------------------------------
    def _detect(self, now: float) -> None:
        timings = read_timings(self.logs_dir, self.run_ts, now, self.max_age_s)
        for rank, score in scores(timings).items():
            if score > self.factor:
                self._below.pop(rank, None)
                since = self._above.setdefault(rank, now)
                if rank not in self._open and now - since >= self.window_s:
                    self._declare(rank, score, timings, since)
            else:
                self._above.pop(rank, None)
                below = self._below.setdefault(rank, now)
                if rank in self._open and now - below >= self.window_s:
                    self._resolve(rank, score, now)
            if rank in self._open:
                self._open[rank]["score"] = round(score, 2)

    def _declare(
        self, rank: int, score: float, timings: dict[int, RankTiming], since: float
    ) -> None:
        j = judge(rank, timings)
        assert j is not None  # scored above, so judged
        line = STRAGGLER.format(
            rank=rank, score=f"{score:.1f}", window=f"{self.window_s:g}", cause=j.cause,
            evidence=j.evidence,
        )  # fmt: skip
        main_log.warning(line)
        episode = {"rank": rank, "score": round(score, 2), "cause": j.cause,
                   "since": round(since, 3), "line": line, "resolved": None}  # fmt: skip
        self._open[rank] = episode
        self.episodes.append(episode)

    def _resolve(self, rank: int, score: float, now: float) -> None:
        episode = self._open.pop(rank)
        line = STRAGGLER_RESOLVED.format(
            rank=rank, seconds=f"{now - episode['since']:.0f}", score=f"{score:.1f}"
        )
        main_log.warning(line)
        episode["resolved"] = line
        resolved = [e for e in self.episodes if e["resolved"] is not None]
        drop = {id(e) for e in resolved[:-EPISODES_KEPT]}
        self.episodes = [e for e in self.episodes if id(e) not in drop]

    # --- the other ranks --------------------------------------------------------------------
    def _follow(self) -> None:
        try:
            raw = json.loads(self._heartbeat(self.detector_rank()).read_text())
            episodes = [e for e in raw.get("stragglers") or [] if e.get("rank") == self.ctx.rank]
        except (OSError, ValueError, AttributeError):
            return
        for e in episodes:
            for resolved, line in ((False, e.get("line")), (True, e.get("resolved"))):
                key = (e.get("since"), resolved)
                if line and key not in self._told:
                    self._told.add(key)
                    logger.info(line)  # INFO: the train log has it from the detecting rank
