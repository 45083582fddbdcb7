"""The attempts of a job that restarted (`--max_restarts`): each attempt is a run of its own (its
own TS), and the first line of a restarted attempt's train log is the launcher's RESTART line,
which names the run before it. Following those lines both ways from any attempt gives them all,
each with its verdict."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from rich.console import Console

from ae.diagnose.epoch_coverage import samples_per_epoch
from ae.diagnose.goodput import job_goodput
from ae.diagnose.job_chain import job_chain, restart_lines
from ae.diagnose.log_files import RunFiles, list_runs
from ae.diagnose.report import diagnose, verdict_lines


def attempts(
    files: RunFiles, doc: dict[str, Any], judge: Callable[[RunFiles], dict[str, Any]]
) -> list[dict[str, Any]]:
    """The attempts of the job that run `files` (diagnosed as `doc`) belongs to, oldest first:
    `{attempt, run, status, verdict, restart, samples_per_epoch}` (`restart`: the RESTART line
    that started it; `samples_per_epoch`: what its ranks trained of each epoch, all together).
    `judge` diagnoses another attempt's run."""
    runs = list_runs(files.logs_dir)
    lines = restart_lines(runs)
    chain = job_chain(files.ts, runs, lines)
    out = []
    for i, ts in enumerate(chain):
        d = doc if ts == files.ts else judge(runs[ts])
        out.append({"attempt": i, "run": ts, "status": d["status"], "verdict": verdict(d),
                    "restart": lines.get(ts),
                    "samples_per_epoch": samples_per_epoch(runs.get(ts, files))})  # fmt: skip
    return out


def diagnose_job(files: RunFiles, tail: int = 0) -> dict[str, Any]:
    """`ae-diagnose --json`: the run's diagnosis, with the attempts of its job."""
    doc = diagnose(files, tail)
    doc["attempts"] = attempts(files, doc, diagnose)
    doc["goodput"] = job_goodput(files, doc["attempts"][-1]["status"] in ("failed", "hung"))
    return doc


def verdict(doc: dict[str, Any]) -> str:
    """An attempt's verdict in one line: its first culprit (or the network), else its status."""
    named = doc["culprits"] or doc.get("network") is not None
    return verdict_lines(doc)[0] if named else doc["status"]


def render_attempts(found: list[dict[str, Any]], console: Console) -> None:
    """After the run's own table: the job's attempts, one verdict each (nothing for a job that
    ran once)."""
    if len(found) < 2:
        return
    console.print()
    console.print(f"Attempts of this job: {len(found)}")
    for a in found:
        said = a["status"] if a["verdict"] == a["status"] else f"{a['status']}: {a['verdict']}"
        console.print(f"  {a['attempt']}  run {a['run']}  {said}")
