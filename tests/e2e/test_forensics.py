"""End-to-end forensics: real 2-rank DDP runs (gloo, CPU) through the launcher, with AE_FAULT."""

from __future__ import annotations

import contextlib
import json
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

import psutil
import pytest

from ae.diagnose.log_files import find_run
from ae.diagnose.report import diagnose
from ae.log_lines import FATAL, HEARTBEAT_FIELDS, RECORD_PATTERN, STALL, STALL_RESOLVED
from tests.e2e.conftest import FinishedRun
from tests.support.runs import SERIAL, RunResult, processes_left, run_launcher, run_processes

pytestmark = [pytest.mark.slow, SERIAL]  # stall timeouts and their back-off

T = 3  # --stall_timeout of these runs


@dataclass
class Record:
    time: datetime
    level: str
    rank: int
    worker: str | None
    message: str
    more: list[str] = field(default_factory=list)  # continuation lines: tracebacks, stacks

    @property
    def text(self) -> str:
        return "\n".join([self.message, *self.more])


def read_records(path: Path) -> list[Record]:
    out: list[Record] = []
    for line in path.read_text().splitlines():
        m = RECORD_PATTERN.match(line)
        if m:
            when = datetime.strptime(m["time"], "%Y-%m-%d %H:%M:%S.%f")
            out.append(Record(when, m["level"], int(m["rank"]), m["worker"], m["message"]))
        elif out:
            out[-1].more.append(line)
    return out


@pytest.fixture
def run_dir(tmp_path: Path) -> Iterator[Path]:
    """The run's output dir; whatever process of the run is left at the end is killed."""
    out = tmp_path / "run"
    yield out
    for proc in run_processes(out):
        with contextlib.suppress(psutil.Error):
            proc.kill()


def assert_no_process_left(out_dir: Path) -> None:
    left = processes_left(out_dir)
    assert not left, left


def launch_timed(args: list[str], out: Path, fault: str) -> tuple[RunResult, datetime]:
    res = run_launcher(args, out, env={"AE_FAULT": fault}, timeout=240)
    return res, datetime.now()


def shards(make_shards) -> list[str]:
    train = make_shards([80, 80, 80], name="train")  # 15 batches of 8 per rank
    val = make_shards([32], name="val")
    return [f"--train_shards={train}", f"--val_shards={val}", "--batch_size=8", "--max_epochs=1"]


def stall_episodes(records: list[Record]) -> list[list[tuple[Record, dict]]]:
    """The STALL reports of a rank, split into episodes by its STALL RESOLVED lines."""
    episodes: list[list[tuple[Record, dict]]] = [[]]
    for r in records:
        if (s := STALL.parse(r.message)) is not None:
            episodes[-1].append((r, s))
        elif STALL_RESOLVED.parse(r.message) is not None:
            episodes.append([])
    return [e for e in episodes if e]


def report_after(records: list[Record], stall: Record) -> str:
    """The full report that follows a STALL line, with the workers' faulthandler dumps."""
    i = records.index(stall)
    parts = []
    for r in records[i + 1 :]:
        if STALL.parse(r.message) or STALL_RESOLVED.parse(r.message):
            break
        parts.append(r.text)
    return "\n".join(parts)


def test_stalls_reported_by_stuck_and_waiting_ranks(make_shards, run_dir: Path) -> None:
    """Three hangs in one run:
    1. rank 1's dataloader worker sleeps in data loading for 8 s, rank 0 waits in the gradient
       all-reduce; 2. rank 0 sleeps in its training step for 8 s, rank 1 waits; both resolve.
    3. rank 1 sleeps for good: rank 0's collective times out (--pg_timeout=12) and the job ends."""
    fault = (
        "sleep@data:rank=1:step=3:secs=8,sleep@train:rank=0:step=7:secs=8,"
        "sleep@train:rank=1:step=11:secs=120"
    )
    args = [*shards(make_shards), "--num_workers=2", "--debug=true", f"--stall_timeout={T}",
            "--pg_timeout=12"]  # fmt: skip
    res, ended = launch_timed(args, run_dir, fault)
    assert res.returncode != 0, res.output
    r0 = read_records(res.log("debug_rank0_*.log")[0])
    r1 = read_records(res.log("debug_rank1_*.log")[0])
    ep0, ep1 = stall_episodes(r0), stall_episodes(r1)
    assert len(ep0) == 3 and len(ep1) == 3, (ep0, ep1)

    def since_last_step_line(rec: Record) -> float:
        records = r0 if rec.rank == 0 else r1
        before = records[: records.index(rec)]
        last = next(r for r in reversed(before) if r.message.startswith("Training step"))
        return (rec.time - last.time).total_seconds()

    for episode in (*ep0, *ep1):
        # Within stall_timeout + 2 s of the rank's last progress (its last step line), and
        # repeated with back-off: report k at >= T * 2**(k-1) s of idle time.
        rec, s = episode[0]
        assert float(s["idle"]) <= T + 2 and since_last_step_line(rec) <= T + 2
        for k, (_, s) in enumerate(episode):
            assert int(s["report"]) >= 1 and float(s["idle"]) >= T * 2**k

    # 1. rank 1 stuck in data loading: its main thread waits for the worker, which sleeps.
    rec, s = ep1[0][0]
    assert s["phase"] == "data loading" and s["collective"] == "no"
    report = report_after(r1, rec)
    assert "Thread MainThread" in report and "worker  pid=" in report
    assert "in _injected_sleep" in report  # from the worker's faulthandler dump
    assert len(ep1[0]) >= 2  # 8 s: reports at 3 and 6 s
    _, s = ep0[0][0]  # rank 0 waits in the gradient all-reduce
    assert s["phase"] == "training step" and s["collective"].startswith("yes")
    # 2. rank 0 stuck in its training step; rank 1 waits in the collective.
    rec, s = ep0[1][0]
    assert s["phase"] == "training step" and s["collective"] == "no"
    assert s["frame"].startswith("_injected_sleep (ae/forensics/faults.py:")
    assert "in _injected_sleep" in report_after(r0, rec)
    assert ep1[1][0][1]["collective"].startswith("yes")
    # 3. the waiting rank fails at the process-group timeout instead of hanging.
    assert ep1[2][0][1]["frame"].startswith("_injected_sleep")
    assert ep0[2][0][1]["collective"].startswith("yes")
    fatal = [r for r in r0 if FATAL.parse(r.message)]
    assert fatal and "Timed out" in fatal[0].message
    last_fault = [r for r in r1 if r.message.startswith("FAULT injected: sleep@train at step 1")]
    assert (ended - last_fault[-1].time).total_seconds() < 60
    assert_no_process_left(run_dir)

    # The train log has the one-line WARNINGs of both ranks, not the reports.
    main = res.text("train_*.log")
    assert re.search(r"\[Rank 0/2\] STALL detected", main)
    assert re.search(r"\[Rank 1/2\] STALL detected", main)
    assert "STALL RESOLVED" in main and "Thread MainThread" not in main
    for rank in (0, 1):
        (path,) = res.log(f"heartbeat_rank{rank}_*.json")
        beat = json.loads(path.read_text())
        assert tuple(beat) == HEARTBEAT_FIELDS and beat["rank"] == rank
        assert beat["state"] == "failed" and beat["world_size"] == 2
    # --debug: the distributed libraries' own debug output is in the native files.
    assert "Reducer initialized" in res.text("native_rank1_*.log")
    # ae-diagnose: rank 1, stuck in its step for good, held the job back; rank 0 timed out.
    doc = diagnose(find_run(res.logs))
    assert [(c["rank"], c["cause"]) for c in doc["culprits"]] == [(1, "training step")]
    assert [(v["rank"], v["cause"]) for v in doc["victims"]] == [(0, "peer failure: RuntimeError")]


def test_exception_on_rank1_is_fatal_everywhere_and_ends_the_job(
    rank_1_raises_at_step_3: FinishedRun,
) -> None:
    res, ended = rank_1_raises_at_step_3.result, rank_1_raises_at_step_3.ended
    assert res.returncode != 0
    r1 = read_records(res.log("debug_rank1_*.log")[0])
    (fatal,) = [r for r in r1 if r.message.startswith("FATAL")]
    assert FATAL.parse(fatal.message) == {
        "exc_type": "InjectedFault",
        "where": "main thread",
        "message": "raise fault injected by AE_FAULT",
    }
    assert fatal.more[0] == "Traceback (most recent call last):"
    assert "in _injected_raise" in fatal.text and "in training_step" in fatal.text
    main = read_records(res.log("train_*.log")[0])
    (in_main,) = [r for r in main if r.rank == 1 and r.message.startswith("FATAL")]
    assert in_main.text == fatal.text
    # torchrun's failure report (in the launcher log, off the console) carries the real
    # traceback (@record), not just an exit code.
    report = res.text("launcher_*.log")
    assert "InjectedFault: raise fault injected by AE_FAULT" in report
    assert "_injected_raise" in report and "ChildFailedError" not in res.output
    assert (ended - fatal.time).total_seconds() < 60
    assert not rank_1_raises_at_step_3.left, rank_1_raises_at_step_3.left


def test_segv_and_sigkill_leave_their_traces(make_shards, run_dir: Path) -> None:
    """Rank 1 segfaults and rank 0 is SIGKILLed (the OOM killer) at the same step."""
    res, _ = launch_timed(
        [*shards(make_shards), "--num_workers=1", "--debug=true", f"--stall_timeout={T}"],
        run_dir,
        "segv@train:rank=1:step=3,kill@train:rank=0:step=3",
    )
    assert res.returncode != 0
    text1 = res.text("debug_rank1_*.log")
    assert "Fatal Python error: Segmentation fault" in text1
    assert re.search(r"line \d+ in _injected_segv\n.*line \d+ in fault_point", text1)
    # The line logged right before the SIGKILL is the last one; the one before has the memory.
    lines0 = res.text("debug_rank0_*.log").splitlines()
    assert lines0[-1].endswith("[Rank 0/2] FAULT injected: kill@train at step 3 (rank 0)")
    assert re.search(r"Training step 3, .* rss=\d+MB workers=1x\d+MB$", lines0[-2])
    report = res.text("launcher_*.log")
    assert "exitcode  : -11" in report and "exitcode  : -9" in report
    assert_no_process_left(run_dir)
