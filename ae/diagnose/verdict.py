"""Which rank(s) hold the job back, and why: the rules, applied to the ranks' states in order.

1. Failures: an uncaught exception (`exception: <Type>`), a fatal signal (`fatal signal:
   SIGSEGV`), a non-zero RANK_EXIT (`error exit: <Type>`). An exception that only reports a dead
   or stuck peer (gloo `Connection closed by peer`, DistBackendError, NCCL errors, timeouts,
   SIGTERM from torchrun, broken pipe) makes its rank a victim, not a culprit.
2. A rank whose log just stops (no exit line, no FATAL, no open STALL) and whose process is gone
   (its heartbeat pid, on this host, is dead) or whose peers have ended: `killed without trace`
   (the OOM killer, SIGKILL) -- unless it stopped within GAP_S of another rank's failure, then
   torchrun stopped it (victim).
3. Open stalls: a stalled rank whose main thread is not in a collective is a culprit, the cause is
   its phase; one that waits in a collective (`collective wait: yes`) is a victim. If every
   stalled rank waits, the culprit is a missing rank, else a rank with no STALL of its own (its
   watchdog starved), else the rank(s) behind (lowest step), else all of them (`collective wait`).
4. No STALL (watchdog off or not yet due): ranks without progress for longer than the stall
   timeout; the one that stopped first is the culprit, the cause its phase.
5. If every failure reports a peer, the first rank to fail is the culprit.
Before rules 3-5: if every rank, on two or more hosts, stalled in a collective at the same step
and none failed of its own, no rank is stuck in its own work: the hosts cannot reach each other
(`network`), and no rank is a culprit.
After rules 1-5: a collective mismatch (`ae.diagnose.collectives`: the ranks' Flight Recorder
dumps disagree, or a rank's backend says so) names its rank(s) as the culprit, `collective
mismatch`; the culprits the other rules named become its victims.
A run where every rank wrote its exit line with code 0 and nothing failed has no culprits.
Dead is dead (`name_deaths`): the first rank torchrun saw end, killed by a signal or exited
without an exit line, is `killed (SIGKILL)` / `exited N`, whatever the rules said before.
Last, a culprit whose failure a resource explains gets that resource as its cause
(`ae.diagnose.resources`: disk full, shared memory, the OOM killer, open files).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from ae.diagnose.collectives import Mismatch, find_mismatches
from ae.diagnose.logscan import Evidence
from ae.diagnose.rank_log import Crash, RankLog, Stall
from ae.diagnose.resources import name_resources
from ae.diagnose.run_state import RunState

# A rank gone at most this before a peer's failure was stopped by torchrun: its heartbeat (every
# 5 s at most) or its last line is that old when it dies.
GAP_S = 6.0
STALE_S = 30.0  # a heartbeat this much older than the run's newest sign of life: writer gone
DEFAULT_STALL_TIMEOUT = 300.0  # --stall_timeout default, when the train log does not say

_PEER_TYPES = {
    "DistBackendError", "DistNetworkError", "DistStoreError", "BrokenPipeError",
    "ConnectionResetError", "ConnectionAbortedError", "SignalException", "SIGTERMException",
}  # fmt: skip
_PEER_TEXT = re.compile(
    r"Connection (?:closed|reset) by peer|Broken pipe|gloo/transport|remote (?:worker|process)|"
    r"NCCL (?:error|communicator)|nccl(?:Remote|System)Error|ProcessGroupNCCL|"
    r"Watchdog caught collective operation timeout|Timed out waiting|Socket Timeout|"
    r"got signal: 15|SIGTERM"
)


@dataclass
class Finding:
    rank: int
    phase: str | None
    cause: str
    rule: str
    evidence: list[Evidence] = field(default_factory=list)
    time: float | None = None


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


def is_peer_failure(crash: Crash) -> bool:
    """An exception (any of a chain) that reports a dead, stuck or stopping peer."""
    if crash.signal:
        return False
    return crash.kind in _PEER_TYPES or bool(
        _PEER_TEXT.search("\n".join([crash.message, *crash.chain]))
    )


def primary_crash(r: RankLog) -> Crash | None:
    """The rank's first crash of its own: not a peer's, and not after it got SIGTERM (torchrun
    stopping the job; its dataloader workers die of it too)."""
    stopped = r.sigterm.time if r.sigterm is not None else None
    return next(
        (c for c in r.crashes
         if not is_peer_failure(c) and (stopped is None or c.time < stopped)),
        None,
    )  # fmt: skip


def finished(r: RankLog) -> bool:
    if r.crashes:
        return False
    if r.exit_code is not None:
        return r.exit_code == 0
    return r.heartbeat is not None and r.heartbeat.state == "exited"


def open_stall(r: RankLog) -> Stall | None:
    """The rank's unresolved stall, unless it exited or failed of its own after it. A failure
    that only ends the stall (a peer's error, SIGTERM from torchrun) leaves it open: the stall
    is what happened."""
    s = r.open_stall
    if s is None or finished(r):
        return None
    c = primary_crash(r)
    ends = ([c.time] if c else []) + ([r.exit.time] if r.exit else [])
    return None if any(t >= s.time for t in ends) else s


def current_phase(r: RankLog) -> str:
    if finished(r):
        return "teardown"
    if (s := open_stall(r)) is not None:
        return s.phase
    if r.crashes:
        return r.crashes[0].phase or r.log_phase or "setup"
    hb = r.heartbeat  # the newer of the heartbeat and the log says where the rank is
    if hb is not None and (r.last_time is None or hb.time >= r.last_time):
        return hb.phase
    return r.log_phase or (hb.phase if hb is not None else "setup")


def _last_words(r: RankLog) -> list[Evidence]:
    """Its last line, and the stacks faulthandler dumped when its watchdog could not run."""
    return [e for e in (r.last.evidence if r.last else None, r.native_dump) if e is not None]


class _Judge:
    def __init__(self, run: RunState) -> None:
        self.run = run
        self.culprits: list[Finding] = []
        self.victims: list[Finding] = []
        self.states: dict[int, str] = {}
        self.mismatches: list[Mismatch] = []

    def failures(self) -> float | None:
        """Rule 1; returns the time of the first failure."""
        for r in self.run.ranks.values():
            if (c := primary_crash(r)) is not None:
                self._crashed(
                    r, c, f"{c.kind} in {c.where}" + ("" if c.signal else f": {c.message}")
                )
            elif r.exit_code not in (None, 0) and r.exit is not None:
                why = r.exit.message.rsplit(": ", 1)[-1]
                # The last error with all its lines (a user error's message can span several).
                error = [r.last_error, *r.last_error_more] if r.last_error else []
                evidence = [*error, r.exit.evidence]
                rule = f"exited with code {r.exit_code}"
                phase = current_phase(r)
                self._culprit(r, phase, f"error exit: {why}", rule, evidence, r.exit.time)
                self.states[r.rank] = "error exit"
        times = [f.time for f in self.culprits if f.time is not None]
        return min(times) if times else None

    def gone(self, first_failure: float | None) -> None:
        """Rule 2. Of the ranks gone without trace, the first to go is the culprit; a rank that
        got SIGTERM, or went after (or just before) another rank's failure, was stopped."""
        ranks = self.run.ranks.values()
        ended = {r.rank for r in ranks if r.crashes or r.exit is not None or finished(r)}
        # A rank of this host known dead: a rank of another host that went silent well before
        # it (more than a heartbeat's interval) is gone too (a node lost, its processes killed).
        dead = [
            r.last_sign_of_life or 0.0 for r in ranks if r.heartbeat and r.heartbeat.alive is False
        ]
        before = max(dead, default=float("-inf")) - GAP_S
        gone: list[tuple[float, RankLog, list[Evidence]]] = []
        for r in ranks:
            if not r.files or r.rank in ended or open_stall(r) is not None:
                continue
            hb = r.heartbeat
            alive = hb.alive if hb is not None else None
            stale = hb is not None and (self.run.reference or 0) - hb.time > STALE_S
            silent = hb is not None and hb.time < before
            if alive is not False and not (alive is None and (ended or stale or silent)):
                continue
            evidence = [r.last.evidence] if r.last else []
            if hb is not None and alive is False:
                note = f"pid {hb.pid} on {hb.host} is gone; heartbeat state {hb.state}"
                evidence.append(Evidence(hb.path, 0, note))
            gone.append((r.last_sign_of_life or 0.0, r, evidence))
        failed = ", ".join(str(f.rank) for f in self.culprits)
        first_gone: RankLog | None = None
        for life, r, evidence in sorted(gone, key=lambda g: g[0]):
            self.states[r.rank] = "stopped"
            if r.sigterm is not None:
                self._victim(r, "stopped by SIGTERM", [r.sigterm.evidence])
            elif first_failure is not None and life >= first_failure - GAP_S:
                self._victim(r, f"stopped after rank {failed} failed", evidence[-1:])
            elif first_gone is not None:
                self._victim(r, f"stopped after rank {first_gone.rank} died", evidence[-1:])
            elif r.native_dump is not None or (hb is not None and hb.stalled):
                # The watchdog saw the stall but its report never came: its thread was blocked
                # too (a lock held across threads, native code holding the interpreter lock).
                first_gone = r
                dump = [e for e in (r.native_dump, r.native_dump_main) if e is not None]
                rule = "stalled; its watchdog could not write a STALL report (faulthandler)"
                self._culprit(
                    r, current_phase(r), "stalled, watchdog blocked", rule, evidence + dump, life
                )
            else:
                first_gone = r
                rule = "log stops with no exit line, no exception, no stall"
                self._culprit(r, current_phase(r), "killed without trace", rule, evidence, life)
                self.states[r.rank] = "killed"

    def peers(self) -> None:
        """Victims of rule 1, and rule 5 when no other rule named a culprit."""
        blamed = {f.rank for f in self.culprits} | {f.rank for f in self.victims}
        peer = [
            r for r in self.run.ranks.values()
            if r.crashes and primary_crash(r) is None and r.rank not in blamed
        ]  # fmt: skip
        stopped = [r for r in peer if r.sigterm is not None and r.sigterm.time <= r.crashes[0].time]
        candidates = [r for r in peer if r not in stopped]  # SIGTERM for all: a preemption
        if not self.culprits and candidates:
            first = min(candidates, key=lambda r: r.crashes[0].time)
            self._crashed(first, first.crashes[0], "first rank to fail; all failures name a peer")
            peer.remove(first)
        for r in peer:
            c = r.crashes[0]
            if r in stopped:
                assert r.sigterm is not None
                self._victim(r, "stopped by SIGTERM", [r.sigterm.evidence, c.evidence[0]])
                self.states[r.rank] = "stopped"
            else:
                self._victim(r, f"peer failure: {c.kind}", [c.evidence[0], *c.evidence[-1:]])
                self.states[r.rank] = "peer failure"

    def stalls(self, first_failure: float | None) -> None:
        """Rule 3."""
        ranks = self.run.ranks
        stalls = {r.rank: s for r in ranks.values() if (s := open_stall(r))}
        # A waiting rank that then failed (its collective timed out) is a peer failure (peers()).
        waiting = {rank: s for rank, s in stalls.items() if s.waiting and not ranks[rank].crashes}
        for rank, s in stalls.items():
            if s.waiting:
                if rank in waiting:
                    self.states.setdefault(rank, "waiting")
                continue
            self.states.setdefault(rank, "stalled")
            if first_failure is None or s.began < first_failure:
                rule = f"no progress for {s.idle:.0f}s+ outside a collective"
                self._culprit(ranks[rank], s.phase, s.phase, rule, s.evidence, s.began)
            else:  # stuck since a peer failed: in its teardown, or on a dead peer's socket
                self._victim(ranks[rank], "stalled after a failure", s.evidence[:1])
        if waiting and not self.culprits:
            self._all_waiting(waiting, stalls)
        blamed = {f.rank for f in self.culprits}
        for rank, s in waiting.items():
            if rank not in blamed:
                self._victim(ranks[rank], "collective wait", s.evidence[:1])

    def _all_waiting(self, waiting: dict[int, Stall], stalls: dict[int, Stall]) -> None:
        run = self.run
        if run.missing:
            for rank in run.missing:
                rule = "its peers wait in a collective and it wrote no log"
                self.culprits.append(Finding(rank, None, "missing log", rule))
            return
        quiet = [
            r for r in run.ranks.values()
            if r.files and r.rank not in stalls and r.rank not in self.states
            and not (r.crashes or r.exit or finished(r))
        ]  # fmt: skip
        if quiet:
            for r in quiet:
                rule = "no STALL of its own while its peers wait (watchdog starved?)"
                self._culprit(r, current_phase(r), current_phase(r), rule, _last_words(r))
            return
        low = min(s.step for s in waiting.values())
        behind = [rank for rank, s in waiting.items() if s.step == low]
        rule = (
            f"behind: waits at step {low} while others wait at a later step"
            if len(behind) < len(waiting)
            else "every rank waits in a collective (one that some ranks never call?)"
        )
        for rank in behind:
            s = waiting[rank]
            self._culprit(run.ranks[rank], s.phase, "collective wait", rule, s.evidence[:1])

    def idle(self) -> None:
        """Rule 4."""
        run = self.run
        limit = run.train.stall_timeout or DEFAULT_STALL_TIMEOUT
        running = [r for r in run.ranks.values() if r.rank not in self.states and not finished(r)]
        stuck = [r for r in running if (run.idle_s(r) or 0.0) > limit]
        if not stuck:
            return
        first = min(stuck, key=lambda r: r.progress_time or 0.0)
        idle = run.idle_s(first) or 0.0
        rule = f"no progress for {idle:.0f}s (> {limit:g}s), the first rank to stop"
        self._culprit(first, current_phase(first), current_phase(first), rule, _last_words(first))
        self.states[first.rank] = "stuck"
        for r in stuck:
            if r is not first:
                self._victim(r, "no progress (waiting?)", [r.last.evidence] if r.last else [])
                self.states[r.rank] = "stuck"

    def _crashed(self, r: RankLog, c: Crash, rule: str) -> None:
        cause = f"{'fatal signal' if c.signal else 'exception'}: {c.kind}"
        self._culprit(r, c.phase or r.log_phase or "setup", cause, rule, c.evidence, c.time)
        self.states[r.rank] = "crashed"

    def _culprit(
        self, r: RankLog, phase: str | None, cause: str, rule: str,
        evidence: list[Evidence], time: float | None = None,
    ) -> None:  # fmt: skip
        self.culprits.append(Finding(r.rank, phase, cause, rule, evidence, time))

    def _victim(self, r: RankLog, cause: str, evidence: list[Evidence]) -> None:
        self.victims.append(Finding(r.rank, current_phase(r), cause, "", evidence))


_MISMATCH_RULES = {
    "extra": "issued a collective (#{seq}) that the other ranks did not",
    "mismatch": "called a collective (#{seq}) that differs from the other ranks'",
    "behind": "never joined collective #{seq}, which the other ranks wait in",
    "backend": "its backend found a collective the other ranks did not match",
}


def collective_mismatch(j: _Judge) -> None:
    """A collective mismatch: its rank(s) are the culprits, `collective mismatch`; the culprits
    of the rules before (a rank that waits in a collective, a peer that timed out or lost the
    aborted rank) become victims. A rank behind the others counts only when every culprit so
    far only waits in a collective (else it is behind because it is stuck in its own work)."""
    run = j.run
    waiting = bool(j.culprits) and all(f.cause == "collective wait" for f in j.culprits)
    fatal = {r.rank: c.evidence[0] for r in run.ranks.values() for c in r.crashes[:1] if c.signal}
    found = find_mismatches(run.dumps, run.backend, fatal, all_waiting=waiting)
    if not found:
        return
    j.mismatches = found
    named = {rank for m in found for rank in m.ranks}
    kept = []  # a missing rank (no log at all) stays a culprit: nothing says it only waited
    for f in j.culprits:
        if f.rank in named:
            continue
        if (r := run.ranks.get(f.rank)) is None:
            kept.append(f)
        else:
            j._victim(r, f"{f.cause}, after the collective mismatch", f.evidence[:1])
    j.culprits = kept
    j.victims = [v for v in j.victims if v.rank not in named]
    for m in found:
        rule = _MISMATCH_RULES[m.kind].format(seq=m.seq)
        for rank in m.ranks:
            r = run.ranks.get(rank)
            phase = current_phase(r) if r is not None else None
            if r is not None and r.crashes:  # aborted, or timed out in the mismatched collective
                j.states[rank] = "crashed"
            j.culprits.append(Finding(rank, phase, "collective mismatch", rule, m.evidence))


def network_partition(run: RunState) -> Network | None:
    """The ranks of two or more hosts all stalled, waiting in a collective at the same step, and
    none failed of its own (collective timeouts afterwards are only the consequence)."""
    ranks = [r for r in run.ranks.values() if r.files]
    if len(ranks) < 2 or run.missing or any(primary_crash(r) for r in ranks):
        return None
    stalls = [open_stall(r) for r in ranks]
    if not all(s is not None and s.waiting for s in stalls):
        return None
    steps = {s.step for s in stalls if s is not None}
    hosts = sorted({r.host for r in ranks if r.host is not None})
    if len(steps) != 1 or len(hosts) < 2:
        return None
    return Network(hosts, steps.pop(), [s.evidence[0] for s in stalls if s is not None])


def name_deaths(run: RunState, j: _Judge) -> None:
    """Dead is dead: the first rank torchrun saw end (`ae.diagnose.launcher_log`), of a signal or
    a non-zero exit code without an exit line or a failure of its own, is named for that,
    `killed (SIGKILL)` / `exited N`, also when it had stalled first (the stall moves into the
    rule); if a signal other than a stop signal killed it, it is a culprit even if it only
    waited: nothing in the job kills that way. Ranks that ended after it were stopped by
    torchrun: their findings stay as the rules made them."""
    for r in run.ranks.values():
        end = run.ends.get(r.rank)
        # Only the first end torchrun saw: after it, torchrun stops the other ranks itself. A
        # rank that got a stop signal left because of it (128 + the signal), whoever sent it.
        if end is None or not end.first or primary_crash(r) is not None or r.sigterm:
            continue
        found = next((f for f in j.culprits if f.rank == r.rank), None)
        # Only a kill from outside makes a culprit of a rank no rule named: a stop signal or an
        # exit code may be the launcher's doing (the first end torchrun saw on its node).
        if found is None and end.signal in (None, "SIGTERM", "SIGINT"):
            continue
        if found is None:
            j.victims = [v for v in j.victims if v.rank != r.rank]
            last = [r.last.evidence] if r.last else []
            found = Finding(r.rank, current_phase(r), "", "", last, r.last_sign_of_life)
            j.culprits.append(found)
        before = f"; before: {found.cause} ({found.rule})" if found.cause else ""
        if found.cause == "killed without trace":
            before = f"; {found.rule}"
        found.rule = f"its process ended: {end.describe}, says torchrun{before}"
        found.cause = end.describe
        found.evidence = [*found.evidence, end.evidence]
        j.states[r.rank] = "killed" if end.signal else "error exit"


def judge(run: RunState) -> Verdict:
    if (net := network_partition(run)) is not None:
        j = _Judge(run)
        for r in run.ranks.values():
            state = "peer failure" if r.crashes else "waiting"
            j.states[r.rank] = state
            if (s := open_stall(r)) is not None:
                j._victim(r, "collective wait (network)", s.evidence[:1])
        status = "failed" if any(r.crashes for r in run.ranks.values()) else "hung"
        return Verdict(status, [], sorted(j.victims, key=lambda f: f.rank), j.states, net)
    j = _Judge(run)
    first_failure = j.failures()
    j.gone(first_failure)
    first_failure = min((f.time for f in j.culprits if f.time is not None), default=first_failure)
    j.stalls(first_failure)
    j.peers()
    if not j.culprits and not j.victims:
        j.idle()
    collective_mismatch(j)
    for r in run.ranks.values():
        alive = r.heartbeat.alive if r.heartbeat else None
        default = "exited" if finished(r) else ("running" if alive is not False else "stopped")
        j.states.setdefault(r.rank, default)
    name_deaths(run, j)
    all_done = not run.missing and all(finished(r) for r in run.ranks.values())
    if all_done and not j.culprits:
        status = "finished"
    elif any(j.states.get(f.rank) in ("crashed", "error exit", "killed") for f in j.culprits):
        status = "failed"
    elif j.culprits:
        status = "hung"
    elif any(s == "running" for s in j.states.values()):
        status = "running"
    else:
        status = "stopped"
    name_resources(j.culprits, run.ranks)
    by_rank = sorted(j.culprits, key=lambda f: f.rank)
    victims = sorted(j.victims, key=lambda f: f.rank)
    return Verdict(status, by_rank, victims, j.states, mismatches=j.mismatches)
