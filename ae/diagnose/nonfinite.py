"""Non-finite values in a run (`ae.training.nonfinite`), from the ranks' logs: the first one in
time (the lowest step, then the earliest line: the rank that received it through the all-reduce
writes no NONFINITE line), the steps skipped and rolled back, and the loss spikes. The verdict
rule `verdict_rules.nonfinite` and the `nonfinite` key of `ae-diagnose --json` read it here."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ae.diagnose.evidence import RunState
from ae.diagnose.logscan import Evidence, Record
from ae.log_lines import LOSS_SPIKE, NONFINITE


@dataclass(frozen=True)
class FirstNonFinite:
    rank: int
    step: int
    epoch: int
    batch: str
    value: str
    samples: str
    time: float
    evidence: Evidence


def _first(rank: int, rec: Record) -> FirstNonFinite | None:
    m = NONFINITE.parse(rec.message)
    if m is None:
        return None
    return FirstNonFinite(
        rank, int(m["step"]), int(m["epoch"]), m["batch"], m["value"], m["samples"], rec.time,
        rec.evidence,
    )  # fmt: skip


def first_nonfinite(run: RunState) -> list[FirstNonFinite]:
    """The NONFINITE lines at the lowest step of any rank (several ranks when they saw it at
    the same step), earliest first; [] when no rank wrote one."""
    found = [f for r in run.ranks.values() if r.nonfinite for f in [_first(r.rank, r.nonfinite)]]
    found = [f for f in found if f is not None]
    if not found:
        return []
    step = min(f.step for f in found)
    return sorted((f for f in found if f.step == step), key=lambda f: (f.time, f.rank))


def nonfinite_json(run: RunState) -> dict[str, Any] | None:
    """The `nonfinite` key of `--json`, or None when the run met no non-finite value and no
    spike."""
    firsts = first_nonfinite(run)
    spikes = [(r.rank, rec) for r in run.ranks.values() for rec in r.spikes]
    if not firsts and not spikes:
        return None
    ranks = run.ranks.values()
    return {
        "first": [
            {
                "rank": f.rank,
                "step": f.step,
                "epoch": f.epoch,
                "batch": f.batch,
                "value": f.value,
                "samples": f.samples,
                "line": f.evidence.text,
            }
            for f in firsts
        ],
        # Every rank writes each SKIPPED and ROLLBACK line: the most any rank wrote.
        "skipped_steps": max((r.skipped_steps for r in ranks), default=0),
        "rollbacks": max((r.rollbacks for r in ranks), default=0),
        "spikes": [
            {"rank": rank, "step": int(m["step"]), "loss": float(m["loss"]), "line": rec.message}
            for rank, rec in spikes
            if (m := LOSS_SPIKE.parse(rec.message)) is not None
        ],
    }
