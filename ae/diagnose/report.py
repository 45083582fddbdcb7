"""The diagnosis of a run (`diagnose`) as one JSON-ready dict, and its rich rendering (built from
that same dict, so the table and `--json` cannot say different things). Keys are documented in
docs/CONTRACT.md."""

from __future__ import annotations

from collections import defaultdict
from datetime import datetime
from typing import Any

from rich.console import Console
from rich.table import Table
from rich.text import Text

from ae.diagnose import stragglers as slow_ranks
from ae.diagnose.evidence import RunState, read_run
from ae.diagnose.findings import Finding
from ae.diagnose.flight_recorder import Dump
from ae.diagnose.log_files import RunFiles
from ae.diagnose.logscan import Evidence, LogBytes
from ae.diagnose.nonfinite import nonfinite_json, survived_line
from ae.diagnose.rank_log import RankLog, shard_of
from ae.diagnose.rank_status import current_phase
from ae.diagnose.stragglers import StragglerFinding, find_stragglers, rank_scores
from ae.diagnose.teardown import how_held, stopped_by, teardown_line
from ae.diagnose.verdict import Verdict, judge
from ae.log_lines import LAUNCHER_LOG_FILE, RECORD_PATTERN

TEXT_LIMIT = 400  # characters of a log line kept in the JSON (FATAL messages can be huge)
SHARDS_LISTED = 10
PLAN_KEYS = ("shards", "samples", "batches", "batch_size", "ranks", "workers", "mode", "dropped",
             "repeated")  # fmt: skip
_STATE_STYLE = {
    "crashed": "bold red", "killed": "bold red", "error exit": "bold red", "stalled": "bold red",
    "stuck": "bold red", "waiting": "yellow", "peer failure": "yellow", "stopped": "yellow",
    "exited": "green", "running": "",
}  # fmt: skip


def _time(t: float | None) -> str | None:
    return None if t is None else datetime.fromtimestamp(t).strftime("%Y-%m-%d %H:%M:%S.%f")[:-3]


def _round(x: float | None) -> float | None:
    return None if x is None else round(x, 1)


def _evidence(e: Evidence) -> dict[str, Any]:
    return {"file": e.path.name, "line": e.line or None, "text": e.text[:TEXT_LIMIT]}


def _finding(run: RunState, f: Finding) -> dict[str, Any]:
    r = run.ranks.get(f.rank)
    return {
        "rank": f.rank,
        "host": r.host if r is not None else None,
        "phase": f.phase,
        "cause": f.cause,
        "rule": f.rule,
        "evidence": [_evidence(e) for e in f.evidence],
    }


def _step_time(r: RankLog) -> dict[str, Any] | None:
    timing = r.heartbeat.timing if r.heartbeat else None
    if timing is None or timing.recent is None:
        return None
    w = timing.recent
    return {"window_s": w.window_s, "steps": w.steps, "own_ms": w.own_ms, "data_ms": w.data_ms,
            "compute_ms": w.compute_ms, "sync_ms": w.sync_ms}  # fmt: skip


def _straggler(f: StragglerFinding) -> dict[str, Any]:
    evidence = [_evidence(e) for e in f.evidence]
    return {"rank": f.rank, "score": round(f.score, 2), "cause": f.cause, "evidence": evidence}


def _dump(d: Dump) -> dict[str, Any]:
    last = {pg: max(calls) for pg, calls in d.calls.items() if calls}
    return {"rank": d.rank, "file": d.path.name, "reason": d.reason, "time": _time(d.time),
            "calls": sum(map(len, d.calls.values())), "last_seq": last}  # fmt: skip


def _rank(
    run: RunState, r: RankLog, state: str, tail: int, score: float | None, phase: str | None
) -> dict[str, Any]:
    hb = r.heartbeat
    end = run.ends.get(r.rank)
    out: dict[str, Any] = {
        "rank": r.rank,
        "state": state,
        "phase": phase or current_phase(r),
        "step": r.step,
        "epoch": r.epoch,
        "silent_s": _round(run.silent_s(r)),
        "idle_s": _round(run.idle_s(r)),
        "last_marker": r.marker_text or None,
        "last_line_time": _time(r.last_time),
        "last_line": _evidence(r.last.evidence) if r.last else None,
        "memory": r.memory,
        "rss_mb": hb.rss_mb if hb else None,
        "workers_rss_mb": hb.workers_rss_mb if hb else None,
        "errors": r.errors,
        "warnings": r.warnings,
        "stall_reports": r.stall_reports,
        "exit_code": r.exit_code if end is None else end.exit_code,
        "signal": None if end is None else end.signal,
        "pid": hb.pid if hb else None,
        "host": r.host,
        "alive": False if end is not None else hb.alive if hb else None,
        "resources": hb.resources if hb else None,
        "heartbeat_age_s": _round(run.reference - hb.time) if hb and run.reference else None,
        "score": None if score is None else round(score, 2),
        "step_time": _step_time(r),
        "logs": [p.name for p in r.files],
    }
    if tail and r.files:
        out["tail"] = [e.text for e in LogBytes.read(r.files[-1]).tail(tail)]
    return out


def _plan_mismatch(run: RunState) -> dict[str, dict[str, str]]:
    """Split -> {rank: plan} when the ranks logged different global shard plans (the fields
    every rank must agree on; a line may go on with this rank's own share)."""
    out: dict[str, dict[str, str]] = {}
    splits = {split for r in run.ranks.values() for split in r.shard_plans}
    for split in sorted(splits):
        plans = {}
        for r in run.ranks.values():
            if r.files:
                p = r.shard_plans.get(split)
                plans[r.rank] = " ".join(f"{k}={p[k]}" for k in PLAN_KEYS) if p else "no plan line"
        if len(set(plans.values())) > 1:
            out[split] = {str(rank): plan for rank, plan in sorted(plans.items())}
    return out


def _data_errors(run: RunState) -> dict[str, Any]:
    by_shard: dict[str, list[Any]] = defaultdict(lambda: [0, set(), None])
    for r in run.ranks.values():
        for rec in r.shard_errors:
            entry = by_shard[shard_of(rec)]
            entry[0] += 1
            entry[1].add(r.rank)
            entry[2] = entry[2] or rec.evidence
    ranked = sorted(by_shard.items(), key=lambda kv: -kv[1][0])[:SHARDS_LISTED]
    return {
        "lines": sum(r.shard_error_lines for r in run.ranks.values()),
        "shards": [
            {"shard": shard, "lines": n, "ranks": sorted(ranks), "first": _evidence(first)}
            for shard, (n, ranks, first) in ranked
        ],
    }


def diagnose(files: RunFiles, tail: int = 0) -> dict[str, Any]:
    """The diagnosis of a run as the `--json` object."""
    run = read_run(files)
    return to_json(run, judge(run), tail)


def to_json(run: RunState, verdict: Verdict, tail: int = 0) -> dict[str, Any]:
    scores = rank_scores(run)
    ended = {f.rank: f.phase for f in verdict.teardown}  # past training, whatever it logged last
    return {
        "run": run.files.ts,
        "logs_dir": str(run.files.logs_dir),
        "status": verdict.status,
        "world_size": run.world_size,
        "newest_line": _time(run.newest_line),
        "ranks": [
            _rank(
                run,
                r,
                verdict.states.get(r.rank, "running"),
                tail,
                scores.get(r.rank),
                ended.get(r.rank),
            )
            for r in run.ranks.values()
        ],
        "culprits": [_finding(run, f) for f in verdict.culprits],
        "victims": [_finding(run, f) for f in verdict.victims],
        "network": None
        if (net := verdict.network) is None
        else {
            "hosts": net.hosts,
            "step": net.step,
            "cause": f"network: hosts {' and '.join(net.hosts)} cannot reach each other",
            "evidence": [_evidence(e) for e in net.evidence],
        },
        "missing_ranks": run.missing,
        "shard_plan_mismatch": _plan_mismatch(run),
        "data_errors": _data_errors(run),
        "stragglers": [_straggler(f) for f in find_stragglers(run)],
        "bound": slow_ranks.job_bound(run),
        "nonfinite": nonfinite_json(run),
        "stopped_by": stopped_by(run),
        "training_finished": None
        if (fin := verdict.finished) is None
        else {
            "step": fin.step,
            "checkpoint": fin.checkpoint,
            "rank0": (r0 := run.ranks.get(0)) is not None and r0.training_finished is not None,
            "evidence": _evidence(fin.evidence),
        },
        "teardown": [_finding(run, f) for f in verdict.teardown],
        "collectives": {
            "dumps": [_dump(d) for _, d in sorted(run.dumps.items())],
            "mismatches": [m.to_json() for m in verdict.mismatches],
        },
    }


# --- rendering ------------------------------------------------------------------------------
def _num(x: Any) -> str:
    return "-" if x is None else f"{x:g}" if isinstance(x, float) else str(x)


def _score(r: dict[str, Any], slow: dict[int, str]) -> Text:
    """`1.7x data` in yellow for a straggler, `1.0x` for the others, `-` without step times."""
    if r["score"] is None:
        return Text("-")
    if r["rank"] in slow:
        return Text(f"{r['score']:.1f}x {slow[r['rank']]}", style="bold yellow")
    return Text(f"{r['score']:.1f}x")


def _rank_table(doc: dict[str, Any]) -> Table:
    table = Table(show_edge=False, pad_edge=False, header_style="bold")
    slow = {s["rank"]: s["cause"] for s in doc["stragglers"]}
    for name in ("rank", "state", "phase", "last marker", "epoch", "step", "last line",
                 "silent s", "idle s", "score", "memory", "errors", "warn", "stalls"):  # fmt: skip
        numeric = name in ("rank", "epoch", "step", "silent s", "idle s", "errors", "warn")
        wrap = name in ("last marker", "memory")
        table.add_column(
            name, justify="right" if numeric or name == "stalls" else "left", no_wrap=not wrap
        )
    for r in doc["ranks"]:
        memory = r["memory"] or (f"rss={r['rss_mb']:.0f}MB" if r["rss_mb"] is not None else "-")
        when = r["last_line_time"][11:] if r["last_line_time"] else "-"
        table.add_row(
            str(r["rank"]), Text(r["state"], style=_STATE_STYLE.get(r["state"], "")),
            r["phase"] or "-", r["last_marker"] or "-", _num(r["epoch"]), _num(r["step"]), when,
            _num(r["silent_s"]), _num(r["idle_s"]), _score(r, slow), memory, _num(r["errors"]),
            _num(r["warnings"]), _num(r["stall_reports"]),
        )  # fmt: skip
    return table


def _where(e: dict[str, Any]) -> str:
    return f"{e['file']}:{e['line']}" if e["line"] else e["file"]


def _what(e: dict[str, Any]) -> str:
    m = RECORD_PATTERN.match(e["text"])  # a record: its clock time and message are enough
    return f"{m['time'][11:]} {m['message']}" if m else e["text"].strip()


def _print_evidence(console: Console, evidence: list[dict[str, Any]]) -> None:
    for e in evidence:
        line = Text(f"    {_where(e)}  ", style="dim")
        line.append(_what(e))
        console.print(line, overflow="ellipsis", no_wrap=True)


def verdict_lines(doc: dict[str, Any], width: int = 160, rules: bool = False) -> list[str]:
    """The verdict in a few plain lines, for a console that is not ae-diagnose's (the launcher's,
    after a failed run): each culprit's rank, phase and cause (`rules`: and why, in brackets),
    then its evidence lines."""
    if (net := doc.get("network")) is not None:
        head = (f"no rank is stuck in its own work: every rank waits for the others in a "
                f"collective at step {net['step']}; {net['cause']}")  # fmt: skip
        return [head, *(_cut(f"    {_where(e)}  {_what(e)}", width) for e in net["evidence"])]
    survived = _survived(doc.get("nonfinite"))
    if (calm := teardown_line(doc)) is not None:
        return [calm, *_teardown_evidence(doc, width), *survived]
    if not doc["culprits"]:
        return [f"No rank is named as the cause (run {doc['status']}).", *survived]
    lines = []
    for c in doc["culprits"]:
        host = f" on {c['host']}" if c.get("host") else ""
        why = f" ({c['rule']})" if rules and c.get("rule") else ""
        lines.append(f"rank {c['rank']}{host}, phase {c['phase'] or '?'}: {c['cause']}{why}")
        for e in c["evidence"]:
            lines.append(_cut(f"    {_where(e)}  {_what(e)}", width))
    return lines


def _teardown_evidence(doc: dict[str, Any], width: int) -> list[str]:
    """The TRAINING_FINISHED line, then each end's evidence (`teardown_line` says the rest)."""
    evidence = [doc["training_finished"]["evidence"], *(e for f in doc["teardown"]
                                                        for e in f["evidence"])]  # fmt: skip
    return [_cut(f"    {_where(e)}  {_what(e)}", width) for e in evidence]


def _survived(nonfinite: dict[str, Any] | None) -> list[str]:
    """A run that survived non-finite steps (`--on_nonfinite=skip|rollback`): how, and the first
    NONFINITE line."""
    if (head := survived_line(nonfinite)) is None:
        return []
    assert nonfinite is not None
    return [head, *(f"    {f['line']}" for f in nonfinite["first"])]


def _cut(line: str, width: int) -> str:
    return line if len(line) <= width else line[: width - 3] + "..."


def render(doc: dict[str, Any], console: Console) -> None:
    status = doc["status"]
    style = {"finished": "green", "running": "green", "stopped": "yellow"}.get(status, "bold red")
    head = Text(f"Run {doc['run']} in {doc['logs_dir']}: {doc['world_size'] or '?'} ranks, ")
    head.append(status.upper(), style=style)
    head.append(f"; newest line {doc['newest_line'] or '-'}")
    console.print(head)
    console.print(_rank_table(doc))
    console.print()
    culprits, net = doc["culprits"], doc.get("network")
    stragglers = doc["stragglers"]
    if net is not None:
        console.print(Text(
            f"Verdict: no rank is stuck in its own work: every rank waits for the others in a "
            f"collective at step {net['step']}; the {net['cause']}. Check the link between "
            "them (interface, cable, switch, firewall).", style="bold red",
        ))  # fmt: skip
        _print_evidence(console, net["evidence"])
    elif (calm := teardown_line(doc)) is not None:
        console.print(Text(f"Verdict: {calm}.", style="yellow"))
        _print_evidence(console, [doc["training_finished"]["evidence"]])
        for f in doc["teardown"]:
            console.print(f"  rank {f['rank']}: {f['cause']} (phase {f['phase']}; {f['rule']})")
            _print_evidence(console, f["evidence"])
    elif not doc["ranks"]:
        why = {
            "stopped": "torchrun got a stop signal first",
            "failed": "torchrun failed: its output says why",
            "running": "torchrun has written nothing yet: it waits for the other nodes, or "
            "was stopped before it began",
        }[status]
        launcher_log = f"{doc['logs_dir']}/{LAUNCHER_LOG_FILE.format(ts=doc['run'])}"
        console.print(Text(f"Verdict: no rank has started; {why} ({launcher_log}).", style=style))
    elif not culprits and stragglers:
        slowed = ", ".join(f"rank {s['rank']}: {s['cause']}" for s in stragglers)
        console.print(Text(f"Verdict: {status}, slowed by {slowed}", style="bold yellow"))
    elif not culprits and (stop := doc.get("stopped_by")):
        why = (f", sent as its launcher (pid {stop['launcher_gone']}) died"
               if stop.get("launcher_gone") else "")  # fmt: skip
        console.print(Text(
            f"Verdict: no rank holds the job back (stopped by {stop['signal']} at step "
            f"{stop['step']}{why}; checkpoint {stop['checkpoint']} saved; resume with "
            "--resume_from_checkpoint=last).", style="yellow",
        ))  # fmt: skip
    elif not culprits:
        console.print(Text(f"Verdict: no rank holds the job back ({status}).", style=style))
    else:
        ranks = ", ".join(str(c["rank"]) for c in culprits)
        console.print(Text(f"Verdict: {how_held(doc)} rank {ranks}", style="bold red"))
    for c in culprits:
        host = f" on {c['host']}" if c.get("host") else ""
        line = Text(f"  rank {c['rank']}{host}: ", style="bold")
        line.append(c["cause"], style="bold red")
        line.append(f"  (phase {c['phase'] or '?'}; {c['rule']})")
        console.print(line)
        _print_evidence(console, c["evidence"])
    for v in doc["victims"]:
        console.print(f"  rank {v['rank']}: {v['cause']} (phase {v['phase'] or '?'}), a victim")
        _print_evidence(console, v["evidence"])
    if stragglers:
        console.print("Stragglers (score: own time per step / the other ranks' median):")
    for s in stragglers:
        line = Text(f"  rank {s['rank']}: {s['score']:.1f}x, cause ", style="bold")
        line.append(s["cause"], style="bold yellow")
        console.print(line)
        _print_evidence(console, s["evidence"])
    if not culprits and (bound := doc.get("bound")) is not None:
        console.print(slow_ranks.bound_line(bound, len(doc["ranks"])))
    if (survived := survived_line(doc["nonfinite"])) is not None:
        console.print(Text(survived, style="yellow"))
    if doc["missing_ranks"]:
        missing = ", ".join(map(str, doc["missing_ranks"]))
        console.print(Text(f"Missing ranks (no debug log): {missing}", style="bold red"))
    for split, plans in doc["shard_plan_mismatch"].items():
        console.print(Text(f"Shard plans differ ({split}):", style="bold red"))
        for rank, plan in plans.items():
            console.print(f"    rank {rank}: {plan}")
    errors = doc["data_errors"]
    if errors["lines"]:
        console.print(f"Data errors: {errors['lines']} ERROR lines name a shard; most named:")
        for s in errors["shards"]:
            console.print(f"    {s['lines']:>6}  {s['shard']}  (ranks {s['ranks']})")
    for r in doc["ranks"]:
        if "tail" in r:
            console.print(Text(f"\nLast lines of {r['logs'][-1]}:", style="bold"))
            for line in r["tail"]:
                console.print(Text(line), overflow="ellipsis", no_wrap=True)
