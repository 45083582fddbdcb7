"""Non-finite values in a run (`ae.training.nonfinite`), from the ranks' logs: the first one in
time (the lowest step, then the earliest line: the rank that received it through the all-reduce
writes no NONFINITE line), the last one (the step that stopped a run that had skipped or rolled
back earlier ones), the steps skipped and rolled back, and the loss spikes. The verdict rule
`verdict_rules.nonfinite` and the `nonfinite` key of `ae-diagnose --json` read it here."""

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
    found = [_first(r.rank, r.nonfinite) for r in run.ranks.values() if r.nonfinite]
    return _at_step(found, min)


def last_nonfinite(run: RunState) -> list[FirstNonFinite]:
    """The NONFINITE lines at the highest step of any rank: the step a run stopped on, after
    the steps it skipped or rolled back (`--max_skipped_steps`); the first ones otherwise."""
    found = [_first(r.rank, r.nonfinite_last) for r in run.ranks.values() if r.nonfinite_last]
    return _at_step(found, max)


def _at_step(found: list[FirstNonFinite | None], pick: Any) -> list[FirstNonFinite]:
    """The lines of `found` at the step `pick` (min or max) chooses, earliest first."""
    lines = [f for f in found if f is not None]
    if not lines:
        return []
    step = pick(f.step for f in lines)
    return sorted((f for f in lines if f.step == step), key=lambda f: (f.time, f.rank))


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


def survived_line(nonfinite: dict[str, Any] | None) -> str | None:
    """One line on the non-finite steps a run survived (`--on_nonfinite=skip|rollback`), from
    the `nonfinite` key of `--json`: `Non-finite loss: step 37 skipped (rank 1, loss=nan); the
    run went on`; None when it survived none (a run stopped on its first is named a culprit)."""
    if not nonfinite or not nonfinite["first"]:
        return None
    skipped, rollbacks = nonfinite["skipped_steps"], nonfinite["rollbacks"]
    if not skipped and not rollbacks:
        return None
    first = nonfinite["first"]
    value = first[0]["value"]  # `loss=nan`, `gradient=inf in <parameter>`
    ranks = sorted({f["rank"] for f in first})
    who = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))}"
    # One run has one --on_nonfinite: its steps were all skipped or all rolled back.
    done, count = ("skipped", skipped) if skipped else ("rolled back", rollbacks)
    more = f", {count} steps {done} in all" if count > 1 else ""
    return (f"Non-finite {value.split('=')[0]}: step {first[0]['step']} {done} ({who}, {value})"
            f"{more}; the run went on")  # fmt: skip
