"""Reader: the stragglers of a run, each rank's score from its heartbeat, the ranks named slow
(the lines `ae.forensics.stragglers` writes).

A rank is a straggler while the detector's `STRAGGLER` line for it (train log) has no
`STRAGGLER RESOLVED` after it: the detector alone applies `--straggler_window`. Scores and causes
are recomputed from the heartbeats with the detector's own rules (`ae.stragglers`), so a live
run shows where things stand now; a run without heartbeat step times keeps the line's figures.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ae.diagnose.evidence import RunState
from ae.diagnose.logscan import Evidence
from ae.log_lines import STRAGGLER
from ae.stragglers import RankSplit, RankTiming, bound_of, judge, scores, verdict_words


@dataclass
class StragglerFinding:
    rank: int
    score: float  # own time per step / the other ranks' median
    cause: str  # data or compute
    evidence: list[Evidence] = field(default_factory=list)


def timings(run: RunState) -> dict[int, RankTiming]:
    return {
        r.rank: r.heartbeat.timing
        for r in run.ranks.values()
        if r.heartbeat is not None and r.heartbeat.timing is not None
    }


def rank_scores(run: RunState) -> dict[int, float]:
    """Rank -> score (1.0 = median) over each rank's recent window; ranks without one left out."""
    return scores(timings(run))


def find_stragglers(run: RunState) -> list[StragglerFinding]:
    found = []
    now = timings(run)
    for rank, rec in sorted(run.train.stragglers.items()):
        m = STRAGGLER.parse(rec.message)
        if m is None:
            continue
        j = judge(rank, now) if rank in now else None
        finding = StragglerFinding(
            rank, j.score if j else float(m["score"]), j.cause if j else m["cause"], [rec.evidence]
        )
        beat = run.ranks[rank].heartbeat if rank in run.ranks else None
        window = now[rank].recent if rank in now else None
        if j is not None and beat is not None and window is not None:
            text = (
                f"now: own {window.own_ms:.1f} ms per step (data {window.data_ms:.1f}, compute "
                f"{window.compute_ms:.1f}), sync {window.sync_ms:.1f} ms, over the last "
                f"{window.window_s:g} s; {j.score:.1f}x the median; {j.evidence}"
            )
            finding.evidence.append(Evidence(beat.path, 0, text))
        found.append(finding)
    return found


def job_bound(run: RunState) -> dict[str, Any] | None:
    """What bounds the job now (`--json`: `bound`): the rule of the train log's `Throughput`
    line (`ae.stragglers.bound_of`) over the ranks' recent heartbeat windows, with the advice
    for an input-bound job (from the run's `--num_workers`). None without step times."""
    windows = {r: t.recent for r, t in timings(run).items() if t.recent is not None}
    splits = [RankSplit(r, w.data_ms, w.compute_ms, w.sync_ms) for r, w in windows.items()]
    bound = bound_of(splits)
    if bound is None:
        return None
    hosts = [r.host for r in run.ranks.values()]
    pace = run.ranks[bound.rank].host
    local = sum(h == pace for h in hosts) if pace is not None else None
    s = bound.split
    return {
        "rank": bound.rank,
        "bound": bound.bound,
        "window_s": windows[bound.rank].window_s,
        "data_ms": round(s.data_ms, 1),
        "compute_ms": round(s.compute_ms, 1),
        "sync_ms": round(s.sync_ms, 1),
        "words": verdict_words(bound, run.train.num_workers, local, None),
    }


def bound_line(bound: dict[str, Any], ranks: int) -> str:
    """The table's `Where the time goes` line, from `--json`'s `bound`."""
    who = f"rank {bound['rank']}'s heartbeat" if ranks > 1 else "the heartbeat"
    return (
        f"Where the time goes ({who}, last {bound['window_s']:g} s): data wait "
        f"{bound['data_ms']:g}, compute {bound['compute_ms']:g}, sync {bound['sync_ms']:g} ms "
        f"per step; {bound['words']}"
    )
