"""Which rank(s) hold the job back, and why: `judge` applies the rules of
`ae.diagnose.verdict_rules` to the ranks' states, in the order `RULES` declares (each rule's
docstring says what it finds), then names the resource that ran out (`ae.diagnose.resources`).

Before the rules: if every rank, on two or more hosts, stalled in a collective at the same step
(or one step on: a link that drops mid-collective can let one side finish it and wait in the
next; or a wait that ended at the collective's timeout, then a failure on the closed pair in the
same step: `rank_status.network_stall`) and none failed of its own, no rank is stuck in its own
work: the hosts cannot reach each other (`network`), and no rank is a culprit. A run where every
rank wrote its exit line with code 0 and nothing failed has no culprits, and so has one whose
ranks died only after training finished (`ae.diagnose.teardown`: their ends are its `teardown`,
the run `finished`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace

from ae.diagnose.collectives import Mismatch
from ae.diagnose.deaths import deaths
from ae.diagnose.evidence import RunState
from ae.diagnose.findings import Finding, Findings
from ae.diagnose.logscan import Evidence
from ae.diagnose.rank_status import current_phase, finished, network_stall, primary_crash
from ae.diagnose.resources import name_resources
from ae.diagnose.teardown import Finished, after_training, training_finished
from ae.diagnose.verdict_rules import (
    collective_mismatch,
    failures,
    gone,
    idle,
    nonfinite,
    peers,
    stalls,
    unnamed_states,
)

Rule = Callable[[RunState, Findings], Findings]

# The order the rules apply in: each sees what the ones before it found.
RULES: tuple[Rule, ...] = (
    failures,
    nonfinite,
    gone,
    stalls,
    peers,
    idle,
    collective_mismatch,
    unnamed_states,
    deaths,
    after_training,
)


@dataclass
class Network:
    """Every rank waits for the others in the same collective, on hosts that cannot reach each
    other: the link between them, not any rank's own work."""

    hosts: list[str]
    step: int
    evidence: list[Evidence]


@dataclass
class Verdict:
    status: str  # finished, running, hung, failed, stopped
    culprits: list[Finding]
    victims: list[Finding]
    states: dict[int, str]  # rank -> exited, crashed, killed, stalled, waiting, running, ...
    network: Network | None = None
    mismatches: list[Mismatch] = field(default_factory=list)  # the collective mismatches found
    teardown: list[Finding] = field(default_factory=list)  # ends after training finished
    finished: Finished | None = None  # the run's TRAINING_FINISHED line, if any


def network_partition(run: RunState) -> Network | None:
    """The ranks of two or more hosts all stalled, waiting in a collective at the same step (or
    one step apart: gloo's all-reduce can complete on one side of a link that drops during it,
    and that rank waits in the next step's first collective), and none failed of its own
    (collective timeouts afterwards are only the consequence)."""
    ranks = [r for r in run.ranks.values() if r.files]
    if len(ranks) < 2 or run.missing or any(primary_crash(r) for r in ranks):
        return None
    stalled = [network_stall(r) for r in ranks]
    if not all(s is not None and s.waiting for s in stalled):
        return None
    steps = {s.step for s in stalled if s is not None}
    hosts = sorted({r.host for r in ranks if r.host is not None})
    if max(steps) - min(steps) > 1 or len(hosts) < 2:
        return None
    return Network(hosts, min(steps), [s.evidence[0] for s in stalled if s is not None])


def _network_verdict(run: RunState, net: Network) -> Verdict:
    """Every rank a victim of the network: `peer failure` when its collective then timed out."""
    states = {r.rank: "peer failure" if r.crashes else "waiting" for r in run.ranks.values()}
    victims = [
        Finding(r.rank, current_phase(r), "collective wait (network)", "", s.evidence[:1])
        for r in run.ranks.values()
        if (s := network_stall(r)) is not None
    ]
    status = "failed" if any(r.crashes for r in run.ranks.values()) else "hung"
    return Verdict(status, [], sorted(victims, key=lambda f: f.rank), states, net)


def _status(run: RunState, found: Findings) -> str:
    if not run.ranks:  # no rank wrote a line: never "finished"
        return _status_before_the_ranks(run)
    all_done = not run.missing and all(finished(r) for r in run.ranks.values())
    if (all_done or found.teardown) and not found.culprits:
        # Ended on a stop signal after its save (Ctrl-C, scancel, preemption): not the end of
        # training, though every rank exited 0.
        return "stopped" if any(r.preempted for r in run.ranks.values()) else "finished"
    if any(found.states.get(f.rank) in ("crashed", "error exit", "killed") for f in found.culprits):
        return "failed"
    if found.culprits:
        return "hung"
    if any(s == "running" for s in found.states.values()):
        return "running"
    return "stopped"


def _status_before_the_ranks(run: RunState) -> str:
    """A run whose ranks never wrote (stopped in startup, its nodes never all joined): `stopped`
    when torchrun got a stop signal, `failed` when it wrote anything else (its error report),
    else `running` (torchrun waits for its nodes, silent, or has just begun)."""
    if run.stopped is not None:
        return "stopped"
    wrote = any(p.is_file() and p.stat().st_size for p in run.files.launcher_logs)
    return "failed" if wrote else "running"


def processes_gone(run: RunState) -> bool:
    """Every rank's process is known to have ended: its exit line, torchrun's report, its
    heartbeat's state or its pid (on this host) says so."""
    if run.missing or not run.ranks:
        return False
    for r in run.ranks.values():
        hb = r.heartbeat
        ended = hb is not None and (hb.alive is False or hb.state != "running")
        if not (r.exit is not None or r.rank in run.ends or ended):
            return False
    return True


def _after_the_end(run: RunState, verdict: Verdict) -> Verdict:
    """A hang whose processes are all gone (stopped with Ctrl-C, killed) is over: `stopped`. The
    culprits and the ranks' states stay: what held the job back, and what each rank was doing
    when it ended (the timeline draws a stall to the end)."""
    if verdict.status not in ("hung", "running") or not processes_gone(run):
        return verdict
    return replace(verdict, status="stopped")


def judge(run: RunState) -> Verdict:
    if (net := network_partition(run)) is not None:
        return _after_the_end(run, _network_verdict(run, net))
    found = Findings()
    for rule in RULES:
        found = rule(run, found)
    culprits = name_resources(found.culprits, run.ranks)
    verdict = Verdict(
        _status(run, found),
        sorted(culprits, key=lambda f: f.rank),
        sorted(found.victims, key=lambda f: f.rank),
        dict(found.states),
        mismatches=list(found.mismatches),
        teardown=list(found.teardown),
        finished=training_finished(run),
    )
    return _after_the_end(run, verdict)
