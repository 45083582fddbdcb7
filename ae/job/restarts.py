"""Self-healing runs: after a failed attempt, judge it and either restart the job from its newest
checkpoint or say why not.

A loop around torchrun, not torchrun's own `--max-restarts`: between two attempts the launcher
needs the failed attempt's verdict (`ae.diagnose`, read from that attempt's logs) to decide
(a user error or the same failure twice ends the job) and to say why it restarts; and each
attempt needs its own run TS, so that its logs are an attempt of their own, and its ranks need
`--resume_from_checkpoint=last`, which torchrun would not add. torchrun's elastic restart would
restart the workers with the same arguments, in the same logs, without a word to the launcher.

Stop rules, in order: a stop signal (Ctrl-C, preemption) is never a failure; a user error (exit 2)
or a full disk (28) in any rank ends the job, as without restarts; the same failure (the same
culprit causes at the same step) in two attempts in a row ends it with `SAME_FAILURE_EXIT`; after
`--max_restarts` restarts the last failure ends it.

A SLURM job asked to save by SIGUSR1 (`ae.job.supervise`) is requeued once its ranks have saved
(`requeue_job`): SLURM starts it again, and the recipe's `--resume_from_checkpoint=last` resumes it.
"""

from __future__ import annotations

import os
import re
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from loguru import logger

from ae.diagnose.log_files import find_run, list_runs
from ae.diagnose.report import diagnose, verdict_lines
from ae.errors import DiskFullError, UserError
from ae.job.outcome import finished_in_teardown
from ae.job.rank_env import AS_THE_FIRST_ATTEMPT
from ae.log_lines import CHANGE_OF_NODES, RESTART, RESUMED, TRAIN_LOG_FILE

RUNS_LOOKED_BACK = 5  # the runs `resume_note` reads, newest first, for one that trained
# The job failed the same way twice in a row: a requeue would fail again (docs/RUNS.md).
SAME_FAILURE_EXIT = 3
# Failures no restart can help: the same mistake or the same full disk again.
NO_RESTART = {UserError.exit_code: "a user error", DiskFullError.exit_code: "the disk is full"}
SAME_FAILURE = "not restarting: the same failure at step {step} twice"
# How ae-diagnose's cause for a rank that stopped on a non-finite value begins
# (`verdict_rules.nonfinite`: `non-finite loss=nan at step 8`).
NONFINITE_CAUSE = "non-finite "
_STEP_FILE = re.compile(r"^step-(\d+)\.ckpt$")
LAST = "last.ckpt"


@dataclass(frozen=True)
class Attempt:
    """One failed attempt of a job, as its verdict says."""

    ts: str
    failed: str  # the verdict in one line: `rank 1 on node1, phase training step: exception: X`
    step: int  # the step at which it failed
    causes: tuple[str, ...]  # the culprits' causes: with `step`, what makes two failures the same
    rank_exit_codes: tuple[int, ...]  # the non-zero exit codes the ranks logged


@dataclass(frozen=True)
class Restart:
    """The next attempt: its RESTART line and the flags it adds to the ranks' command line."""

    line: str
    args: list[str]


def judge(logs: Path, ts: str, rc: int) -> Attempt:
    """The verdict of the attempt that ran as `ts` and ended with `rc` (its ranks' logs)."""
    try:
        doc: dict[str, Any] | None = diagnose(find_run(logs, ts))
    except UserError:  # no rank wrote a log
        doc = None
    if doc is None or not doc["ranks"]:
        return Attempt(ts, f"exit {rc} before any rank wrote a log", 0, (f"exit {rc}",), ())
    head = verdict_lines(doc)[0]
    steps = {r["rank"]: r["step"] for r in doc["ranks"]}
    culprits = doc["culprits"]
    if (net := doc.get("network")) is not None:
        step, causes = net["step"], (net["cause"],)
    else:
        # The ranks step together: the job's step is the newest any rank shows. A killed rank's
        # own may be older (its last line or heartbeat came before the kill).
        step = max((s for s in steps.values() if s is not None), default=0)
        causes = tuple(sorted(c["cause"] for c in culprits)) if culprits else (f"exit {rc}",)
    codes = tuple(sorted({r["exit_code"] for r in doc["ranks"] if r["exit_code"]}))
    return Attempt(ts, head, step, causes, codes)


def newest_checkpoint(checkpoints: Path) -> tuple[int, Path] | None:
    """The step and file `--resume_from_checkpoint=last` reads: the step file that `last.ckpt`
    is a hard link to (or, where it is a copy, the newest step file); None without one."""
    last = checkpoints / LAST
    if not last.is_file():
        return None
    steps = sorted(
        (int(m[1]), p) for p in checkpoints.glob("step-*.ckpt") if (m := _STEP_FILE.match(p.name))
    )
    same = [(s, p) for s, p in steps if os.path.samefile(p, last)]
    return (same or steps or [(0, last)])[-1]


def resume_note(checkpoints: Path, resume: str | None, logs: Path, ts: str) -> str | None:
    """What a resume by hand (`--resume_from_checkpoint`, a checkpoint of this folder) trains
    again: the steps the folder's previous run went past that checkpoint (killed, or failed,
    after its last save), as a RESTART line says them for a restart. None when it redoes none
    (that run saved where it stopped: a stop signal, its end), or that cannot be told."""
    found = _checkpoint_step(checkpoints, resume) if resume is not None else None
    if found is None or not logs.is_dir():
        return None
    step, path = found
    before = sorted((t for t in list_runs(logs) if t < ts), reverse=True)
    # The newest run that trained: one refused before its first step (another model, a
    # damaged checkpoint) went nowhere; a few runs back at most
    for previous in before[:RUNS_LOOKED_BACK]:
        try:
            reached = judge(logs, previous, 0).step
        except (OSError, ValueError, KeyError):  # a note is no reason to stop a launch
            return None
        if reached > 0:
            break
    else:
        return None
    if reached <= step:
        return None
    again = f"step {reached} is" if reached == step + 1 else f"steps {step + 1}-{reached} are"
    redone = f"{reached - step} step{'s' * (reached - step != 1)} redone"
    return (
        f"Resuming at step {step} ({path}): the previous run, {previous}, reached step "
        f"{reached}; {again} trained again ({redone})"
    )


def _checkpoint_step(checkpoints: Path, resume: str) -> tuple[int, Path] | None:
    """The step and file of `--resume_from_checkpoint` when it is a step checkpoint of this
    folder (or `last`); None otherwise (another folder's, `best.ckpt`)."""
    if resume == "last":
        found = newest_checkpoint(checkpoints)
        return found if found is not None and found[1].name != LAST else None
    path = Path(resume).expanduser()
    if not path.is_file() or path.resolve().parent != checkpoints.resolve():
        return None
    if m := _STEP_FILE.match(path.name):
        return int(m[1]), path
    linked = [p for p in checkpoints.glob("step-*.ckpt") if os.path.samefile(p, path)]
    return next(((int(m[1]), p) for p in linked if (m := _STEP_FILE.match(p.name))), None)


def _resumed_step(logs: Path, ts: str) -> int:
    """The step an attempt resumed at (its RESUMED line), 0 for one that started afresh."""
    train_log = logs / TRAIN_LOG_FILE.format(ts=ts)
    text = train_log.read_text(errors="replace") if train_log.is_file() else ""
    found = [int(m["step"]) for line in text.splitlines() if (m := RESUMED.parse(line))]
    return found[-1] if found else 0


class Restarts:
    """The failed attempts of one job, and whether the next one starts."""

    def __init__(self, max_restarts: int, logs: Path, checkpoints: Path) -> None:
        self.max = max_restarts
        self.logs = logs
        self.checkpoints = checkpoints
        self.failed: list[Attempt] = []
        self.said: str | None = None  # the line with which the last judgment ended the job

    def after_failure(self, ts: str, rc: int, nodes: str = "") -> Restart | int | None:
        """After attempt `ts` failed with `rc`: the next attempt; or the job's exit code when it
        ends here with a line of its own (0: its training had finished, `finished_in_teardown`);
        or None when it ends as a run without restarts does (the caller reports the failure).
        `nodes`: the NODES_CHANGED line of a job that goes on with other nodes
        (`ae.job.elastic`), "" for the same ones."""
        if (done := finished_in_teardown(self.logs, ts)) is not None:
            # Killed only after training finished: no failure, and nothing a restart could redo
            # (torchrun's agent asks here too, `ae.job.elastic`): the job ends, exit 0.
            self.said = done
            logger.warning(done)
            return 0
        attempt = judge(self.logs, ts, rc)
        self.failed.append(attempt)
        for code in attempt.rank_exit_codes:
            if code in NO_RESTART:
                why = NO_RESTART[code]
                if nonfinite := [c for c in attempt.causes if c.startswith(NONFINITE_CAUSE)]:
                    # exit 2 too, but no mistake of the command: the same weights and batches
                    # from the same checkpoint would meet it again
                    why = f"the run stopped on a {nonfinite[0]}, which a restart would meet again"
                self.said = f"Not restarting: {why} (exit {code} from a rank)"
                logger.info(self.said)
                return None
        if len(self.failed) >= 2:
            before = self.failed[-2]
            if (before.causes, before.step) == (attempt.causes, attempt.step):
                self.said = f"{SAME_FAILURE.format(step=attempt.step)}: {attempt.failed}"
                logger.error(self.said)
                return SAME_FAILURE_EXIT
        n = len(self.failed)
        if n > self.max:
            self.said = f"Not restarting: all {self.max} restart(s) used"
            logger.error(self.said)
            return None
        return self._next(ts, n, attempt.failed, attempt.step, nodes)

    def after_change(self, ts: str, nodes: str) -> Restart:
        """After attempt `ts` was stopped, healthy, to take in a node that joined (torchrun's
        membership change; its ranks saved a checkpoint on the way out): the next attempt,
        counting no restart."""
        step = judge(self.logs, ts, 0).step
        return self._next(ts, len(self.failed), CHANGE_OF_NODES, step, nodes)

    def _next(self, ts: str, n: int, failed: str, step: int, nodes: str) -> Restart:
        found = newest_checkpoint(self.checkpoints)
        if found is None:
            resume, where, args = _resumed_step(self.logs, ts), AS_THE_FIRST_ATTEMPT, []
        else:
            resume, path = found
            where = str(path)
            args = ["--resume_from_checkpoint=last", "--overwrite=false"]
        return Restart(RESTART.format(
            attempt=n, max=self.max, failed=failed, step=step, resume=resume,
            checkpoint=where, redone=max(0, step - resume), previous=ts,
            nodes=f"; {nodes}" if nodes else "",
        ), args)  # fmt: skip


def requeue_job(env: Mapping[str, str]) -> None:
    """After SIGUSR1 and the ranks' save: `scontrol requeue` this SLURM job (an array job's
    task as `ARRAYJOB_TASK`), which SLURM then starts again from the top of its script."""
    job = env.get("SLURM_JOB_ID")
    if job is None:
        logger.warning("SIGUSR1 outside a SLURM job: saved and stopped; nothing to requeue")
        return
    if (array := env.get("SLURM_ARRAY_JOB_ID")) and (task := env.get("SLURM_ARRAY_TASK_ID")):
        job = f"{array}_{task}"
    try:
        done = subprocess.run(
            ["scontrol", "requeue", job], capture_output=True, text=True, timeout=60
        )
        problem = (done.stderr.strip() or f"exit {done.returncode}") if done.returncode else None
    except (OSError, subprocess.TimeoutExpired) as e:
        problem = str(e)
    if problem:
        logger.error(f"Could not requeue SLURM job {job} (scontrol requeue {job}): {problem}")
    else:
        logger.warning(f"Requeued SLURM job {job}: it starts again, resuming from that checkpoint")
