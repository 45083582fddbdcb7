"""The rules of the verdict, one function each: `rule(run, so_far) -> Findings`.

A rule reads the run and what the rules before it found (`so_far`, frozen) and returns the
findings after it: so far plus its own, or, for the two rules that revise (a collective mismatch,
a death torchrun saw: `ae.diagnose.deaths`), so far revised. No rule changes the record it was
given or reaches into another rule. Their order is declared once, `ae.diagnose.verdict.RULES`.
"""

from __future__ import annotations

from ae.diagnose.collectives import find_mismatches
from ae.diagnose.evidence import RunState
from ae.diagnose.findings import Finding, Findings
from ae.diagnose.logscan import Evidence
from ae.diagnose.nonfinite import last_nonfinite
from ae.diagnose.rank_log import RankLog, Stall
from ae.diagnose.rank_status import current_phase, finished, last_words, open_stall, primary_crash
from ae.diagnose.tracebacks import Crash

# A rank gone at most this before a peer's failure was stopped by torchrun: its heartbeat (every
# 5 s at most) or its last line is that old when it dies.
GAP_S = 6.0
STALE_S = 30.0  # a heartbeat this much older than the run's newest sign of life: writer gone
DEFAULT_STALL_TIMEOUT = 300.0  # --stall_timeout default, when the train log does not say
MISMATCH_CAUSE = "collective mismatch"

_MISMATCH_RULES = {
    "extra": "issued a collective (#{seq}) that the other ranks did not",
    "mismatch": "called a collective (#{seq}) that differs from the other ranks'",
    "behind": "never joined collective #{seq}, which the other ranks wait in",
    "backend": "its backend found a collective the other ranks did not match",
}


def _culprit(
    r: RankLog, phase: str | None, cause: str, rule: str,
    evidence: list[Evidence], time: float | None = None,
) -> Finding:  # fmt: skip
    return Finding(r.rank, phase, cause, rule, evidence, time)


def _victim(r: RankLog, cause: str, evidence: list[Evidence]) -> Finding:
    return Finding(r.rank, current_phase(r), cause, "", evidence)


def _crashed(r: RankLog, c: Crash, rule: str) -> Finding:
    cause = f"{'fatal signal' if c.signal else 'exception'}: {c.kind}"
    return _culprit(r, c.phase or r.log_phase or "setup", cause, rule, c.evidence, c.time)


def failures(run: RunState, so_far: Findings) -> Findings:
    """A rank's own failure makes it a culprit: an uncaught exception (`exception: <Type>`), a
    fatal signal (`fatal signal: SIGSEGV`), a non-zero RANK_EXIT (`error exit: <Type>`). An
    exception that only reports a dead or stuck peer (`rank_status.is_peer_failure`) is left to
    `peers`."""
    culprits: list[Finding] = []
    states: dict[int, str] = {}
    for r in run.ranks.values():
        if (c := primary_crash(r)) is not None:
            rule = f"{c.kind} in {c.where}" + ("" if c.signal else f": {c.message}")
            culprits.append(_crashed(r, c, rule))
            states[r.rank] = "crashed"
        elif r.exit_code not in (None, 0) and r.exit is not None:
            why = r.exit.message.rsplit(": ", 1)[-1]
            # The last error with all its lines (a user error's message can span several).
            error = [r.last_error, *r.last_error_more] if r.last_error else []
            evidence = [*error, r.exit.evidence]
            rule = f"exited with code {r.exit_code}"
            culprits.append(
                _culprit(r, current_phase(r), f"error exit: {why}", rule, evidence, r.exit.time)
            )
            states[r.rank] = "error exit"
    return so_far.plus(culprits, states=states)


# How a rank that stopped on a non-finite value exits (`ae.training.nonfinite`).
_NONFINITE_EXIT = "error exit: NonFiniteError"


def nonfinite(run: RunState, so_far: Findings) -> Findings:
    """A run that stopped on a non-finite value (`--on_nonfinite`): the rank whose NONFINITE line
    at the step it stopped on is first in time (its own loss or gradient held the value; the
    highest step: the steps skipped or rolled back before it were survived) is the culprit,
    `non-finite <value> at step N`, the line (its shard and keys) its evidence; the other ranks
    that stopped on it, which got it through the all-reduce, are its victims. A run that
    survived it keeps no culprit (`ae-diagnose --json`: `nonfinite`)."""
    stopped = {f.rank: f for f in so_far.culprits if f.cause == _NONFINITE_EXIT}
    firsts = [f for f in last_nonfinite(run) if f.rank in stopped] if stopped else []
    if not firsts:
        return so_far
    named = {f.rank for f in firsts}
    culprits = [f for f in so_far.culprits if f.rank not in stopped]
    for f in firsts:
        was = stopped[f.rank]
        rule = f"the NONFINITE line it stopped on (step {f.step}, epoch {f.epoch}, batch {f.batch})"
        cause = f"non-finite {f.value} at step {f.step}"
        culprits.append(_culprit(run.ranks[f.rank], "training step", cause, rule,
                                 [f.evidence, *was.evidence], f.time))  # fmt: skip
    who = ", ".join(map(str, sorted(named)))
    victims = [
        _victim(run.ranks[rank], f"stopped on rank {who}'s non-finite value", found.evidence[-1:])
        for rank, found in stopped.items()
        if rank not in named
    ]
    return Findings(tuple(culprits), (*so_far.victims, *victims), so_far.states, so_far.mismatches)


def _gone_without_trace(run: RunState) -> list[tuple[float, RankLog, list[Evidence]]]:
    """The ranks whose log just stops (no exit line, no failure, no open stall) and whose process
    is gone (its heartbeat pid, on this host, is dead), or whose peers have ended, or whose
    heartbeat is stale: (last sign of life, rank, evidence), the first to go first."""
    ranks = run.ranks.values()
    ended = {r.rank for r in ranks if r.crashes or r.exit is not None or finished(r)}
    # A rank of this host known dead: a rank of another host that went silent well before it
    # (more than a heartbeat's interval) is gone too (a node lost, its processes killed).
    dead = [r.last_sign_of_life or 0.0 for r in ranks if r.heartbeat and r.heartbeat.alive is False]
    before = max(dead, default=float("-inf")) - GAP_S
    gone: list[tuple[float, RankLog, list[Evidence]]] = []
    for r in ranks:
        if not r.files or r.rank in ended or open_stall(r) is not None:
            continue
        hb = r.heartbeat
        alive = hb.alive if hb is not None else None
        stale = hb is not None and (run.reference or 0) - hb.time > STALE_S
        silent = hb is not None and hb.time < before
        if alive is not False and not (alive is None and (ended or stale or silent)):
            continue
        evidence = [r.last.evidence] if r.last else []
        if hb is not None and alive is False:
            note = f"pid {hb.pid} on {hb.host} is gone; heartbeat state {hb.state}"
            evidence.append(Evidence(hb.path, 0, note))
        gone.append((r.last_sign_of_life or 0.0, r, evidence))
    return sorted(gone, key=lambda g: g[0])


def _killed_together(
    run: RunState, found: list[tuple[float, RankLog, list[Evidence]]]
) -> list[int]:
    """The ranks when every rank of the run went without trace within GAP_S, and torchrun,
    whose log is there, saw no rank end and got no stop signal: it died with them (its launcher
    and the whole job killed at once); [] otherwise."""
    ranks = [r for r in run.ranks.values() if r.files]
    if len(found) < 2 or len(found) != len(ranks) or run.ends or run.stopped is not None:
        return []
    if not run.files.launcher_logs or found[-1][0] - found[0][0] > GAP_S:
        return []
    return sorted(r.rank for _, r, _ in found)


def gone(run: RunState, so_far: Findings) -> Findings:
    """Of the ranks gone without trace, the first to go is the culprit, `killed without trace`
    (the OOM killer, SIGKILL), or `stalled, watchdog blocked` when faulthandler dumped its stacks;
    a rank that got SIGTERM, or went after (or within GAP_S before) another rank's failure, or
    after torchrun got a Ctrl-C, was stopped by torchrun (or a second Ctrl-C): a victim -- unless,
    with no failure before it, the stop signal found it stuck in its own work (not waiting in a
    collective: its STOP_SIGNAL_STUCK line says where), which makes it a culprit, its phase the
    cause (a hang stopped before any STALL report)."""
    first_failure = so_far.first_failure
    failed = ", ".join(str(f.rank) for f in so_far.culprits)
    culprits: list[Finding] = []
    victims: list[Finding] = []
    states: dict[int, str] = {}
    first_gone: RankLog | None = None
    ctrl_c = run.stopped is not None and run.stopped.signal == "SIGINT"
    found = _gone_without_trace(run)
    together = _killed_together(run, found)
    for life, r, evidence in found:
        states[r.rank] = "stopped"
        stuck = r.stuck
        if (stuck and "doing" in stuck and not stuck["doing"].startswith("collective")
                and first_failure is None and not (so_far.culprits or culprits)):  # fmt: skip
            # A hang stopped (Ctrl-C, scancel) before any STALL report: the stop signal found
            # this rank stuck in its own work, while the others (if any) waited in a collective.
            states[r.rank] = "stuck"
            rule = (f"no progress for {stuck['idle']}s when {stuck['signal']} came, main thread "
                    f"in {stuck['doing']}")  # fmt: skip
            assert r.stuck_stop is not None
            phase = stuck["phase"]
            culprits.append(_culprit(r, phase, phase, rule, [r.stuck_stop.evidence], life))
        elif r.sigterm is not None:
            victims.append(_victim(r, f"stopped by {r.stop_signal}", [r.sigterm.evidence]))
        elif ctrl_c and first_failure is None and r.rank not in run.ends:
            # torchrun itself got the Ctrl-C (the launcher passes it on) and saw no rank end
            # before it: a rank still on its way to its stop line when a second Ctrl-C SIGKILLed
            # every process ends without trace, stopped with the job. Not on SIGTERM: the
            # launcher sends it to torchrun when another node is lost, whose rank is gone
            # without trace too, and the culprit.
            cause = f"stopped with the job (torchrun got {run.stopped.signal})"
            victims.append(_victim(r, cause, [*evidence[-1:], run.stopped.evidence]))
        elif first_failure is not None and life >= first_failure - GAP_S:
            victims.append(_victim(r, f"stopped after rank {failed} failed", evidence[-1:]))
        elif first_gone is not None and together:
            victims.append(_victim(r, f"killed with the job, as rank {first_gone.rank}",
                                   evidence[-1:]))  # fmt: skip
        elif first_gone is not None:
            victims.append(_victim(r, f"stopped after rank {first_gone.rank} died", evidence[-1:]))
        elif r.native_dump is not None or (r.heartbeat is not None and r.heartbeat.stalled):
            # The watchdog saw the stall but its report never came: its thread was blocked too
            # (a lock held across threads, native code holding the interpreter lock).
            first_gone = r
            dump = [e for e in (r.native_dump, r.native_dump_main) if e is not None]
            rule = "stalled; its watchdog could not write a STALL report (faulthandler)"
            culprits.append(
                _culprit(
                    r, current_phase(r), "stalled, watchdog blocked", rule, evidence + dump, life
                )
            )
        else:
            first_gone = r
            rule = "log stops with no exit line, no exception, no stall"
            if together:  # no rank held the others back: who went first is a matter of ms
                others = ", ".join(str(k) for k in together if k != r.rank)
                rule += (f"; rank {others} stopped with it and torchrun's log names no end: "
                         "every process of the job was killed at once (kill -9, the OOM killer, "
                         "the machine)")  # fmt: skip
            culprits.append(
                _culprit(r, current_phase(r), "killed without trace", rule, evidence, life)
            )
            states[r.rank] = "killed"
    return so_far.plus(culprits, victims, states)


def stalls(run: RunState, so_far: Findings) -> Findings:
    """Open stalls: a stalled rank whose main thread is not in a collective is a culprit, its
    cause its phase (a victim when it stalled after the first failure); one that waits in a
    collective (`collective wait: yes`) is a victim. If every stalled rank waits and no rule
    named a culprit, `_all_waiting` names one."""
    ranks = run.ranks
    first_failure = so_far.first_failure
    stalled = {r.rank: s for r in ranks.values() if (s := open_stall(r))}
    # A waiting rank that then failed (its collective timed out) is a peer failure (`peers`).
    waiting = {rank: s for rank, s in stalled.items() if s.waiting and not ranks[rank].crashes}
    culprits: list[Finding] = []
    victims: list[Finding] = []
    states: dict[int, str] = {}
    for rank, s in stalled.items():
        if s.waiting:
            if rank in waiting and rank not in so_far.states:
                states[rank] = "waiting"
            continue
        if rank not in so_far.states:
            states[rank] = "stalled"
        if first_failure is None or s.began < first_failure:
            rule = f"no progress for {s.idle:.0f}s+ outside a collective"
            culprits.append(_culprit(ranks[rank], s.phase, s.phase, rule, s.evidence, s.began))
        else:  # stuck since a peer failed: in its teardown, or on a dead peer's socket
            victims.append(_victim(ranks[rank], "stalled after a failure", s.evidence[:1]))
    if waiting and not (so_far.culprits or culprits):
        culprits += _all_waiting(run, waiting, stalled, so_far)
    blamed = {f.rank for f in (*so_far.culprits, *culprits)}
    victims += [
        _victim(ranks[rank], "collective wait", s.evidence[:1])
        for rank, s in waiting.items()
        if rank not in blamed
    ]
    return so_far.plus(culprits, victims, states)


def _all_waiting(
    run: RunState, waiting: dict[int, Stall], stalled: dict[int, Stall], so_far: Findings
) -> list[Finding]:
    """Every stalled rank waits in a collective: the culprit is a missing rank (no log at all),
    else a rank with no STALL of its own (its watchdog starved), else the rank(s) behind (the
    lowest step), else all of them (`collective wait`)."""
    if run.missing:
        rule = "its peers wait in a collective and it wrote no log"
        return [Finding(rank, None, "missing log", rule) for rank in run.missing]
    quiet = [
        r for r in run.ranks.values()
        if r.files and r.rank not in stalled and r.rank not in so_far.states
        and not (r.crashes or r.exit or finished(r))
    ]  # fmt: skip
    if quiet:
        rule = "no STALL of its own while its peers wait (watchdog starved?)"
        return [_culprit(r, current_phase(r), current_phase(r), rule, last_words(r)) for r in quiet]
    low = min(s.step for s in waiting.values())
    behind = [rank for rank, s in waiting.items() if s.step == low]
    rule = (
        f"behind: waits at step {low} while others wait at a later step"
        if len(behind) < len(waiting)
        else "every rank waits in a collective (one that some ranks never call?)"
    )
    return [
        _culprit(run.ranks[rank], waiting[rank].phase, "collective wait", rule,
                 waiting[rank].evidence[:1])
        for rank in behind
    ]  # fmt: skip


def peers(run: RunState, so_far: Findings) -> Findings:
    """The ranks whose failures only report a peer are victims (`peer failure`, or `stopped by
    SIGTERM` when torchrun stopped them first); when no rule named a culprit and not every one of
    them got SIGTERM (a preemption), the first of them to fail is the culprit."""
    blamed = so_far.blamed()
    peer = [
        r for r in run.ranks.values()
        if r.crashes and primary_crash(r) is None and r.rank not in blamed
    ]  # fmt: skip
    stopped = [r for r in peer if r.sigterm is not None and r.sigterm.time <= r.crashes[0].time]
    candidates = [r for r in peer if r not in stopped]  # SIGTERM for all: a preemption
    culprits: list[Finding] = []
    victims: list[Finding] = []
    states: dict[int, str] = {}
    if not so_far.culprits and candidates:
        first = min(candidates, key=lambda r: r.crashes[0].time)
        rule = "first rank to fail; all failures name a peer"
        culprits.append(_crashed(first, first.crashes[0], rule))
        states[first.rank] = "crashed"
        peer.remove(first)
    for r in peer:
        c = r.crashes[0]
        if r in stopped:
            assert r.sigterm is not None
            evidence = [r.sigterm.evidence, c.evidence[0]]
            victims.append(_victim(r, f"stopped by {r.stop_signal}", evidence))
            states[r.rank] = "stopped"
        else:
            evidence = [c.evidence[0], *c.evidence[-1:]]
            victims.append(_victim(r, f"peer failure: {c.kind}", evidence))
            states[r.rank] = "peer failure"
    return so_far.plus(culprits, victims, states)


def idle(run: RunState, so_far: Findings) -> Findings:
    """When no rule found anything (no STALL: the watchdog off or not yet due): the ranks without
    progress for longer than the stall timeout; the first to stop is the culprit, its cause its
    phase, the others victims."""
    if so_far.culprits or so_far.victims:
        return so_far
    limit = run.train.stall_timeout or DEFAULT_STALL_TIMEOUT
    running = [r for r in run.ranks.values() if r.rank not in so_far.states and not finished(r)]
    stuck = [r for r in running if (run.idle_s(r) or 0.0) > limit]
    if not stuck:
        return so_far
    first = min(stuck, key=lambda r: r.progress_time or 0.0)
    idle_s = run.idle_s(first) or 0.0
    rule = f"no progress for {idle_s:.0f}s (> {limit:g}s), the first rank to stop"
    phase = current_phase(first)
    victims = [
        _victim(r, "no progress (waiting?)", [r.last.evidence] if r.last else [])
        for r in stuck
        if r is not first
    ]
    states = {r.rank: "stuck" for r in (first, *stuck)}
    return so_far.plus([_culprit(first, phase, phase, rule, last_words(first))], victims, states)


def collective_mismatch(run: RunState, so_far: Findings) -> Findings:
    """A collective mismatch (`ae.diagnose.collectives`: the ranks' Flight Recorder dumps
    disagree, or a rank's backend says so) makes its rank(s) the culprits, `collective mismatch`;
    the culprits found so far (a rank that waits in a collective, a peer that timed out or lost
    the aborted rank) become victims. A rank behind the others counts only when every culprit so
    far only waits in a collective (else it is behind because it is stuck in its own work)."""
    waiting = bool(so_far.culprits) and all(f.cause == "collective wait" for f in so_far.culprits)
    fatal = {r.rank: c.evidence[0] for r in run.ranks.values() for c in r.crashes[:1] if c.signal}
    found = find_mismatches(run.dumps, run.backend, fatal, all_waiting=waiting)
    if not found:
        return so_far
    named = {rank for m in found for rank in m.ranks}
    kept: list[Finding] = []  # a missing rank (no log at all) stays a culprit: it never waited
    demoted: list[Finding] = []
    for f in so_far.culprits:
        if f.rank in named:
            continue
        if (r := run.ranks.get(f.rank)) is None:
            kept.append(f)
        else:
            demoted.append(_victim(r, f"{f.cause}, after the collective mismatch", f.evidence[:1]))
    states = dict(so_far.states)
    for m in found:
        rule = _MISMATCH_RULES[m.kind].format(seq=m.seq)
        for rank in m.ranks:
            r = run.ranks.get(rank)
            phase = current_phase(r) if r is not None else None
            if r is not None and r.crashes:  # aborted, or timed out in the mismatched collective
                states[rank] = "crashed"
            kept.append(Finding(rank, phase, MISMATCH_CAUSE, rule, m.evidence))
    victims = [v for v in (*so_far.victims, *demoted) if v.rank not in named]
    return Findings(tuple(kept), tuple(victims), states, tuple(found))


def unnamed_states(run: RunState, so_far: Findings) -> Findings:
    """The ranks no rule named: `exited`, `running` (its heartbeat's process alive or unknown)
    or `stopped`."""
    states = {}
    for r in run.ranks.values():
        if r.rank not in so_far.states:
            alive = r.heartbeat.alive if r.heartbeat else None
            states[r.rank] = (
                "exited" if finished(r) else ("running" if alive is not False else "stopped")
            )
    return so_far.plus(states=states)
