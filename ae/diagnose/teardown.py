"""The last rule of the verdict, `after_training`: a rank that died after training finished died
in teardown, and the run is finished (`rule(run, so_far) -> Findings`, as in
`ae.diagnose.verdict_rules`).

Training is over for every rank once one rank logged TRAINING_FINISHED: the ranks step together
(each optimizer step waits for every rank's gradients), and a rank's fit returns only after the
last step, its validation and the final checkpoint, which the other ranks wait for. A rank that
then ends of a signal (a `kill -9`, the OOM killer, torchrun's SIGTERM after that) ends in
teardown, with the checkpoints complete: not a culprit, and nothing a restart could redo. Its
phase is `teardown`, whatever marker it logged last (a teardown has none). A rank that failed of
its own (an exception, a non-zero exit line, a stall, a collective mismatch) keeps the verdict
`failed`: this rule then changes nothing.

Also how a run ended that no rank held back: the stop signal it saved on (`stopped_by`), and
the words for culprits that stopped it on purpose, a non-finite value or a user error
(`how_held`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ae.diagnose.evidence import RunState
from ae.diagnose.findings import Finding, Findings
from ae.diagnose.launcher_log import ProcessEnd
from ae.diagnose.logscan import Evidence
from ae.diagnose.rank_log import RankLog
from ae.diagnose.rank_status import open_stall, primary_crash
from ae.errors import UserError
from ae.log_lines import CHECKPOINT_END, PREEMPTED, TRAINING_FINISHED

PHASE = "teardown"
_STOP_SIGNALS = ("SIGTERM", "SIGINT")


@dataclass(frozen=True)
class Finished:
    """The run's training finished: at `step`, as `evidence` (a TRAINING_FINISHED line) says;
    `checkpoint`: the step file its last CHECKPOINT_END line names, if it is of that step."""

    step: int
    evidence: Evidence
    checkpoint: str | None


def training_finished(run: RunState) -> Finished | None:
    """Rank 0's TRAINING_FINISHED line, else another rank's (rank 0 may have died before it
    wrote its own), or None."""
    found = [r for r in sorted(run.ranks.values(), key=lambda r: r.rank) if r.training_finished]
    if not found or (rec := found[0].training_finished) is None:
        return None
    m = TRAINING_FINISHED.parse(rec.message)
    if m is None:
        return None
    step = int(m["step"])
    saved = [r.saved for r in sorted(run.ranks.values(), key=lambda r: r.rank) if r.saved]
    ckpt = next((m["path"] for s in saved if (m := CHECKPOINT_END.parse(s.message))
                 and int(m["step"]) == step), None)  # fmt: skip
    return Finished(step, rec.evidence, ckpt)


def _own_failure(r: RankLog) -> bool:
    """A failure the rank's own log shows: not a death from outside."""
    return primary_crash(r) is not None or r.exit_code not in (None, 0) or open_stall(r) is not None


def _end(run: RunState, rank: int) -> ProcessEnd | None:
    return run.ends.get(rank) or run.after_exit.get(rank)


def _state(end: ProcessEnd | None) -> str:
    if end is None or end.signal not in (None, *_STOP_SIGNALS):
        return "killed"
    return "stopped" if end.signal else "error exit"


def after_training(run: RunState, so_far: Findings) -> Findings:
    """After training finished: the ranks that then ended of a signal or without trace (torchrun
    saw them end, or the rules found them gone) leave the culprits and the victims for
    `teardown` (`killed (SIGKILL)`, its evidence: its last line, torchrun's line), the first end
    torchrun saw first; the verdict is `finished`. Unless a culprit failed of its own."""
    fin = training_finished(run)
    if fin is None or any(_own_failure(r) for r in run.ranks.values()):
        return so_far
    gone = {f.rank for f in so_far.culprits if so_far.states.get(f.rank) in ("killed", "stopped")}
    dead = {rank for rank in run.ranks if _end(run, rank) is not None} | gone
    if any(f.rank not in dead for f in so_far.culprits) or not dead:
        return so_far  # a culprit of another kind (a rank still stuck): not this rule's
    first = [rank for rank in dead if (end := _end(run, rank)) is not None and end.first]

    def order(rank: int) -> tuple[bool, float]:
        return rank not in first, run.ranks[rank].last_sign_of_life or 0.0

    found: list[Finding] = []
    states = dict(so_far.states)
    for rank in sorted(dead, key=order):
        r, end = run.ranks[rank], _end(run, rank)
        cause = end.describe if end is not None else "killed without trace"
        when = f"after training finished at step {fin.step}"
        if r.exit is not None:
            when += ", after its exit line"
        if found:
            when += f", after rank {found[0].rank}'s end (torchrun then stops the other ranks)"
        evidence = [e for e in (r.last and r.last.evidence, end and end.evidence) if e is not None]
        found.append(Finding(rank, PHASE, cause, when, evidence, r.last_sign_of_life))
        states[rank] = _state(end)
    victims = tuple(v for v in so_far.victims if v.rank not in dead)
    return Findings((), victims, states, so_far.mismatches, tuple(found))


def teardown_line(doc: dict) -> str | None:
    """The verdict of a run whose ranks died after training finished, in one line, from
    `ae-diagnose --json`: `Training finished at step 23, its checkpoints complete (...); rank 1
    was then killed (SIGKILL) in teardown, then rank 0 killed (SIGTERM); nothing to redo`; None
    for any other run."""
    fin, ends = doc.get("training_finished"), doc.get("teardown") or []
    if fin is None or not ends or doc["culprits"]:
        return None
    saved = f", its checkpoints complete ({fin['checkpoint']})" if fin["checkpoint"] else ""
    first, *rest = ends
    line = f"Training finished at step {fin['step']}{saved}; rank {first['rank']} was then "
    line += f"{first['cause']} in teardown"
    if rest:
        line += ", then " + ", ".join(f"rank {f['rank']} {f['cause']}" for f in rest)
    if not fin["rank0"] and any(f["rank"] == 0 for f in ends):
        # Rank 0 writes the run's last files after its fit (the loss curve, the loggers' end).
        line += "; rank 0 ended before its own `Training finished` line: its loss curve and the "
        line += "loggers' last writes may be missing"
    return line + "; nothing to redo"


def stopped_by(run: RunState) -> dict[str, Any] | None:
    """The stop signal the run ended on after saving (a rank's PREEMPTED line: Ctrl-C, scancel,
    a preemption), or None."""
    gone = {"launcher_gone": run.stopped.launcher_gone if run.stopped is not None else None}
    for r in run.ranks.values():
        if r.preempted is not None and (m := PREEMPTED.parse(r.preempted.message)):
            return {"signal": m["signal"], "step": int(m["step"]), "checkpoint": m["path"], **gone}
    return None


def how_held(doc: dict[str, Any]) -> str:
    """How the culprits ended the run: a non-finite value and a user error stop it on purpose,
    which no rank held back (`held back by` is for the others: a crash, a kill, a stall)."""
    if all(c["cause"].startswith("non-finite ") for c in doc["culprits"]):
        return "stopped on a non-finite value of"
    codes = {r["rank"]: r["exit_code"] for r in doc["ranks"]}
    if all(codes.get(c["rank"]) == UserError.exit_code for c in doc["culprits"]):
        return "stopped by a user error (exit 2: its message says what to change) on"
    return "held back by"
