"""Reader: the stragglers of a run, each rank's score from its heartbeat, the ranks named slow
(the lines `ae.forensics.stragglers` writes).

A rank is a straggler while the detector's `STRAGGLER` line for it (train log) has no
`STRAGGLER RESOLVED` after it: the detector alone applies `--straggler_window`. Scores and causes
are recomputed from the heartbeats with the detector's own rules (`ae.stragglers`), so a live
run shows where things stand now; a run without heartbeat step times keeps the line's figures.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ae.diagnose.evidence import RunState
from ae.diagnose.logscan import Evidence
from ae.log_lines import STRAGGLER
from ae.stragglers import RankTiming, judge, scores


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
