"""What the launcher says when its child ends: done, stopped by a signal (and where the
checkpoint is), or failed -- then the diagnosis (`ae.diagnose`), not torchrun's report.

On a failure the console gets the verdict: per culprit its rank, phase and cause, its evidence
lines, and the `ae-diagnose` command for more; torchrun's own report stays in
`launcher_<TS>.log`. A user error inside the ranks (bad data, a non-finite value under
`--on_nonfinite=stop`) is its messages instead, each once and whole: what rank 0 or the relay
of the other ranks' lines (`ae.job.rank_lines`) already put on the console is not said again,
except rank 0's message when relayed lines came after it (it would no longer be the last word).
Then, after any failure, the `ae-diagnose` command.
"""

from __future__ import annotations

import signal
import textwrap
from collections.abc import Collection
from pathlib import Path
from typing import Any

from loguru import logger

from ae.diagnose.evidence import read_run
from ae.diagnose.findings import Finding
from ae.diagnose.goodput import goodput_line, job_goodput
from ae.diagnose.log_files import find_run
from ae.diagnose.report import to_json, verdict_lines
from ae.diagnose.teardown import teardown_line
from ae.diagnose.verdict import judge
from ae.errors import UserError
from ae.log_lines import (
    LAUNCHER_LOG_FILE,
    PREEMPTED,
    RANK_ENDED,
    RECORD_PATTERN,
    TRAIN_LOG_FILE,
    TRAINING_FINISHED,
)
from logging_cfg.formats import LineFormat

RESUME = "resume with --resume_from_checkpoint=last"
LAUNCHER_TAIL = 8  # lines of torchrun's report shown when no rank wrote a log


def stop_exit_code(sig: signal.Signals) -> int:
    """128 + the signal: 130 after Ctrl-C, 143 after SIGTERM (what job schedulers expect)."""
    return 128 + int(sig)


def _last_in_train_log(logs: Path, ts: str, line_format: LineFormat) -> dict[str, str] | None:
    train_log = logs / TRAIN_LOG_FILE.format(ts=ts)
    text = train_log.read_text(errors="replace") if train_log.is_file() else ""
    found = [m for line in text.splitlines() if (m := line_format.parse(line))]
    return found[-1] if found else None


def preempted(logs: Path, ts: str) -> dict[str, str] | None:
    """Rank 0's PREEMPTED line in the train log (step, path), or None."""
    return _last_in_train_log(logs, ts, PREEMPTED)


def finished(logs: Path, ts: str) -> dict[str, str] | None:
    """Rank 0's TRAINING_FINISHED line in the train log (step), or None."""
    return _last_in_train_log(logs, ts, TRAINING_FINISHED)


def finished_in_teardown(logs: Path, ts: str) -> str | None:
    """The verdict's line when run `ts` failed only after its training finished (a rank killed
    in teardown, `ae.diagnose.teardown`): the job is done, nothing to restart. None otherwise,
    and for a run whose ranks wrote no log."""
    try:
        run = read_run(find_run(logs, ts))
    except UserError:
        return None
    if not run.ranks:
        return None
    return teardown_line(to_json(run, judge(run)))


def _resume_from(newest: tuple[int, Path] | None) -> str:
    """What `--resume_from_checkpoint=last` would do now, when this stop saved nothing."""
    if newest is None:  # requeue-safe `last`: without a checkpoint it starts afresh
        return "no checkpoint to resume from: --resume_from_checkpoint=last starts from scratch"
    step, path = newest
    return f"{RESUME} continues from step {step} ({path})"


def report_stop(
    logs: Path, ts: str, sig: signal.Signals, killed: bool, newest: tuple[int, Path] | None
) -> int:
    """After a stop signal: where the ranks saved (rank 0's PREEMPTED line in the train log), or,
    when they did not, the checkpoint a resume would start from (`newest`: step and file, None
    without one; `ae.job.restarts.newest_checkpoint`)."""
    train_log = logs / TRAIN_LOG_FILE.format(ts=ts)
    saved = preempted(logs, ts)
    what = "Interrupted" if sig == signal.SIGINT else f"Preempted ({sig.name})"
    if not saved and (stuck := held_back(logs, ts)):
        # Stopped because it hung, before any STALL report: who held it back, before the rest
        head, *evidence = stuck
        logger.warning("\n".join([f"The job was stuck when stopped: {head}", *evidence]))
        logger.info(f"More: ae-diagnose {logs} --run {ts}")
    if killed and saved:  # the save was done when the second Ctrl-C came: say that, once
        logger.warning(
            f"{what} at step {saved['step']}; checkpoint saved at {saved['path']}, then stopped "
            f"at once (second Ctrl-C); {RESUME}"
        )
    elif killed:
        logger.warning(
            f"{what}: stopped at once (second Ctrl-C), without a checkpoint of this moment; "
            f"{_resume_from(newest)}"
        )
    elif saved:
        logger.warning(
            f"{what} at step {saved['step']}; checkpoint saved at {saved['path']}; {RESUME}"
        )
    else:  # stopped before training began, or rank 0 runs on another node with its own log
        logger.warning(
            f"{what} before the ranks saved a checkpoint (none in {train_log}); "
            f"{_resume_from(newest)}"
        )
    return stop_exit_code(sig)


HUNG = ("stalled", "stuck")  # the verdict's states of a rank that held a hung job back


def held_back(logs: Path, ts: str) -> list[str]:
    """The verdict's lines when run `ts` hung and names the rank(s) that held it back (stalled,
    or found stuck by the stop signal: `ae.diagnose.verdict_rules.gone`), else none: a rank
    killed without trace under a stop is no hang."""
    try:
        run = read_run(find_run(logs, ts))
    except UserError:
        return []
    verdict = judge(run)
    hung = verdict.culprits and all(verdict.states.get(c.rank) in HUNG for c in verdict.culprits)
    return verdict_lines(to_json(run, verdict), rules=True) if hung else []


def _messages(texts: list[str]) -> list[str]:
    """Log lines as the messages of their records: a record's continuation lines join it."""
    out: list[str] = []
    for text in texts:
        if (m := RECORD_PATTERN.match(text)) is not None or not out:
            out.append(m["message"] if m else text)
        else:
            out[-1] += "\n" + text
    return out


def user_errors(doc: dict[str, Any], culprits: tuple[Finding, ...]) -> dict[int, list[str]] | None:
    """{rank: its messages, whole} when every culprit left on a user error (its exit code), else
    None. From the findings, not `doc`: its evidence texts are cut for the JSON."""
    exit_codes = {r["rank"]: r["exit_code"] for r in doc["ranks"]}
    if not culprits or any(exit_codes.get(c.rank) != UserError.exit_code for c in culprits):
        return None
    # evidence: the ERROR record(s) (a non-finite value: the NONFINITE line first), their
    # continuation lines, then the exit line
    return {c.rank: _messages([e.text for e in c.evidence[:-1]]) for c in culprits}


def report_failure(
    logs: Path, ts: str, rc: int, said: Collection[str] | None = None, job: str = "Training",
    newest: tuple[int, Path] | None = None, resumable: bool = False,
) -> int:  # fmt: skip
    """The diagnosis of a failed run on the console; returns the launcher's exit code. `said`:
    the messages on the console already that need not be said again (`ae.job.rank_lines`;
    None: no relay followed the run, and rank 0's own are taken as said); `job`: what failed,
    as the console names it (`Training`, `Encoding`); `resumable`: a training run, whose
    failure's verdict is followed by the way on, from `newest`, its newest checkpoint
    (`ae.job.restarts.newest_checkpoint`: None without one)."""
    launcher_log = logs / LAUNCHER_LOG_FILE.format(ts=ts)
    more = f"More: ae-diagnose {logs} --run {ts}"
    if launcher_log.is_file():
        # torchrun's, or the launcher's own line on the rank it started itself
        ours = RANK_ENDED.regex.search(launcher_log.read_text(errors="replace"))
        what = "how the rank ended" if ours else "torchrun's own report"
        more += f"  ({what}: {launcher_log})"
    try:
        run = read_run(find_run(logs, ts))
    except UserError:
        run = None
    if run is None or not run.ranks:
        report = launcher_log.read_text(errors="replace") if launcher_log.is_file() else ""
        tail = report.splitlines()
        shown = "".join(f"\n    {line}" for line in tail[-LAUNCHER_TAIL:])
        logger.error(f"{job} failed (exit {rc}) before any rank wrote a log.{shown}")
        logger.info(more)
        return rc
    verdict = judge(run)
    doc = to_json(run, verdict)
    if (messages := user_errors(doc, verdict.culprits)) is not None:
        # Rank 0 said its own on the console already, and the relay each other rank's ERROR
        # record, whole unless it ran past RECORD_LINES (`said` holds only those it said whole,
        # and rank 0's only while no relayed line came after them): say each message whole,
        # and last.
        shown = set(said) if said is not None else set(messages.get(0, []))
        for _, found in sorted(messages.items()):
            if left := [m for m in found if m not in shown]:
                logger.error("\n".join(left))
                shown.update(left)
        logger.info(more)
        return UserError.exit_code
    head, *evidence = verdict_lines(doc)
    logger.error("\n".join([f"{job} failed: {head}", *evidence]))
    if resumable:  # the way on (was: none said; exit 1 is requeueable, RUNS.md)
        logger.info(f"Once its cause is fixed, or to try again: {_resume_from(newest)}")
    logger.info(more)
    return rc


def say_goodput(logs: Path, ts: str, failed: bool) -> None:
    """At the end of a job that restarted: the GOODPUT line of its attempts (`ae-diagnose
    --goodput`), whose last is run `ts`; `failed`: the job ended in a failure."""
    try:
        found = job_goodput(find_run(logs, ts), failed)
    except (OSError, UserError, ValueError) as e:  # logs gone or unreadable: say so, end anyway
        logger.warning(f"Goodput: not computed ({e})")
        return
    if found is not None and found["attempts"] > 1:
        logger.info(f"{goodput_line(found)}; more: ae-diagnose {logs} --run {ts} --goodput")


def failed_here(logs: Path, ts: str, host: str) -> str | None:
    """The diagnosis's culprits on `host`, a line each (`rank 1 on node1, phase setup: error
    exit: ModelError`, then a user error's message); None when it blames no rank of `host` (they
    only followed another host's failure), or no rank wrote a log."""
    try:
        run = read_run(find_run(logs, ts))
    except UserError:
        return None
    verdict = judge(run)
    doc = to_json(run, verdict)
    messages = user_errors(doc, verdict.culprits) or {}
    lines = []
    for c in doc["culprits"]:
        if c.get("host") == host:
            lines.append(f"rank {c['rank']} on {host}, phase {c['phase'] or '?'}: {c['cause']}")
            lines += [textwrap.indent(m, "    ") for m in messages.get(c["rank"], [])]
    return "\n".join(lines) or None
