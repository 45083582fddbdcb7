"""The last rule of the verdict, `deaths`: a rank's end as torchrun saw it (`killed (SIGKILL)`,
`exited N`) revises what the other rules found (`ae.diagnose.verdict_rules`, whose contract it
follows: `rule(run, so_far) -> Findings`, nothing changed in place). Apart because which end was
the first is a question of its own: torchrun's root cause is not always it (`_first_ends`).
"""

from __future__ import annotations

from dataclasses import replace

from ae.diagnose.evidence import RunState
from ae.diagnose.findings import Finding, Findings
from ae.diagnose.rank_status import current_phase, primary_crash
from ae.diagnose.verdict_rules import MISMATCH_CAUSE


def _ended_of_its_peer(run: RunState, rank: int) -> bool:
    """Whether a victim's end is its peer's doing: torchrun's SIGTERM, or an exit code after an
    exception of its own (gloo's `Connection reset by peer` when the peer's process died, which
    can come before torchrun notices that death)."""
    end, log = run.ends[rank], run.ranks.get(rank)
    return end.signal == "SIGTERM" or (end.signal is None and log is not None and bool(log.crashes))


def _first_ends(run: RunState, so_far: Findings) -> set[int]:
    """The ranks whose end was the first: torchrun's root cause, unless that rank ended on
    torchrun's SIGTERM, or of the exception its peer's closed socket raised, as a victim of that
    peer while another rank ended of a signal from outside. torchrun stops the others only after
    it saw an end; it then names the end with the oldest time, and a rank's error file (the
    victim's exception) can be older than a killed rank's end, which torchrun stamps in whole
    seconds when it notices it."""
    firsts = {rank for rank, end in run.ends.items() if end.first}
    victims = {v.rank for v in so_far.victims}
    if not firsts or not firsts <= victims:
        return firsts
    if not all(_ended_of_its_peer(run, rank) for rank in firsts):
        return firsts
    killed = {
        rank for rank, end in run.ends.items() if end.signal not in (None, "SIGTERM", "SIGINT")
    }
    return killed or firsts


def deaths(run: RunState, so_far: Findings) -> Findings:
    """Dead is dead: the first rank torchrun saw end (`ae.diagnose.launcher_log`), of a signal or
    a non-zero exit code without an exit line or a failure of its own, is named for that,
    `killed (SIGKILL)` / `exited N`, also when it had stalled first (the stall moves into the
    rule); if a signal other than a stop signal killed it, it is a culprit even if it only
    waited: nothing in the job kills that way. A collective mismatch stays the cause (the end
    joins its rule): it is why the rank ended. Ranks that ended after it were stopped by
    torchrun: their findings stay as the rules made them."""
    culprits, victims, states = list(so_far.culprits), list(so_far.victims), dict(so_far.states)
    firsts = _first_ends(run, so_far)
    for r in run.ranks.values():
        end = run.ends.get(r.rank)
        # Only the first end torchrun saw: after it, torchrun stops the other ranks itself. A
        # rank that got a stop signal left because of it (128 + the signal), whoever sent it.
        if end is None or r.rank not in firsts or primary_crash(r) is not None or r.sigterm:
            continue
        at = next((i for i, f in enumerate(culprits) if f.rank == r.rank), None)
        # Only a kill from outside makes a culprit of a rank no rule named: a stop signal or an
        # exit code may be the launcher's doing (the first end torchrun saw on its node).
        if at is None and end.signal in (None, "SIGTERM", "SIGINT"):
            continue
        if at is None:
            victims = [v for v in victims if v.rank != r.rank]
            last = [r.last.evidence] if r.last else []
            culprits.append(Finding(r.rank, current_phase(r), "", "", last, r.last_sign_of_life))
            at = len(culprits) - 1
        found = culprits[at]
        if found.cause == MISMATCH_CAUSE:
            # The mismatch is why it ended (its peers' --pg_timeout, or gloo's abort): it stays
            # the cause, whether the logs are read before that end or after it.
            culprits[at] = replace(
                found,
                rule=f"{found.rule}; then its process ended: {end.describe}, says torchrun",
                evidence=[*found.evidence, end.evidence],
            )
            states[r.rank] = "killed" if end.signal else "error exit"
            continue
        before = f"; before: {found.cause} ({found.rule})" if found.cause else ""
        if found.cause == "killed without trace":
            before = f"; {found.rule}"
        culprits[at] = replace(
            found,
            rule=f"its process ended: {end.describe}, says torchrun{before}",
            cause=end.describe,
            evidence=[*found.evidence, end.evidence],
        )
        states[r.rank] = "killed" if end.signal else "error exit"
    # A first end can also be a rank's own exit line (a user error at setup, exit 2) that came
    # before a slower peer wrote its first line: torchrun then SIGTERMed that peer.
    ended_first = firsts | run.exited_first
    for found in _stopped_by_torchrun(run, culprits, ended_first):
        culprits.remove(found)
        end = run.ends[found.rank]
        after = ", ".join(str(f.rank) for f in culprits if f.rank in ended_first)
        cause = f"stopped by torchrun after rank {after} ended"
        victims.append(Finding(found.rank, found.phase, cause, "", [*found.evidence, end.evidence]))
        states[found.rank] = "stopped"
    return Findings(tuple(culprits), tuple(victims), states, so_far.mismatches)


def _stopped_by_torchrun(run: RunState, culprits: list[Finding], firsts: set[int]) -> list[Finding]:
    """Culprits `killed without trace` whose process torchrun ended with its SIGTERM after the
    first end, which a culprit holds: torchrun stopped them (before their handler wrote a line).
    The `gone` rule orders ranks gone without trace by their last lines, which can be a few ms
    apart the wrong way when a rank is SIGKILLed while its peer waits for it."""
    if not any(f.rank in firsts for f in culprits):
        return []
    return [
        f for f in culprits
        if f.cause == "killed without trace" and f.rank not in firsts
        and (end := run.ends.get(f.rank)) is not None and end.signal == "SIGTERM"
    ]  # fmt: skip
