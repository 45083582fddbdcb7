"""End-to-end ae-diagnose: real 2-rank DDP runs (gloo, CPU) broken on purpose with AE_FAULT, and
`python -m ae.diagnose --json` must name the right rank and phase/cause. Hung runs are diagnosed
live (ranks blocked, processes alive), in under 5 s, then killed."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from ae.log_lines import STALL, STALL_RESOLVED, STOP_SIGNAL_STUCK, STUCK_MAIN_THREAD
from tests.e2e.conftest import FinishedRun
from tests.support.live import live_run
from tests.support.runs import ROOT, SERIAL, run_launcher

pytestmark = [pytest.mark.slow, SERIAL]  # live answers within 5 s, stall timeouts

T = 3  # --stall_timeout of these runs
LIVE_ANSWER_S = 5.0


def stuck_in(logs: Path, rank: int) -> str:
    """What rank's STOP_SIGNAL_STUCK line says its main thread was stuck in."""
    text = next(logs.glob(f"debug_rank{rank}_*.log")).read_text()
    lines = [line for line in text.splitlines() if STOP_SIGNAL_STUCK.parse(line)]
    found = [m for line in lines if (m := STUCK_MAIN_THREAD.parse(line))]
    assert len(found) == 1, text[-2000:]
    return found[0]["doing"]


def shard_args(make_shards, workers: int) -> list[str]:
    train = make_shards([80, 80, 80], name="train")  # 15 batches of 8 per rank
    val = make_shards([32], name="val")
    return [f"--train_shards={train}", f"--val_shards={val}", "--batch_size=8", "--max_epochs=1",
            f"--num_workers={workers}", f"--stall_timeout={T}"]  # fmt: skip


def diagnose_json(logs: Path) -> tuple[dict[str, Any], float]:
    t0 = time.monotonic()
    res = subprocess.run(
        [sys.executable, "-m", "ae.diagnose", str(logs), "--json"],
        cwd=ROOT, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    elapsed = time.monotonic() - t0
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout), elapsed


def culprits(doc: dict[str, Any]) -> list[tuple[int, str | None, str]]:
    return [(c["rank"], c["phase"], c["cause"]) for c in doc["culprits"]]


def stalls(logs: Path, rank: int) -> list[dict[str, str] | None]:
    """The rank's STALL lines parsed, with None for each STALL RESOLVED, in order."""
    out: list[dict[str, str] | None] = []
    for path in logs.glob(f"debug_rank{rank}_*.log"):
        for line in path.read_text(errors="replace").splitlines():
            if "] STALL detected" in line:
                out.append(STALL.parse(line))
            elif "] STALL RESOLVED" in line and STALL_RESOLVED.parse(line):
                out.append(None)
    return out


def wait_for(what: str, check, timeout: float = 120) -> None:
    end = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < end, f"timed out waiting for {what}"
        time.sleep(0.5)


def test_live_hangs_in_data_loading_a_checkpoint_save_then_a_training_step(
    make_shards, tmp_path: Path
) -> None:
    """One run, three hangs, each diagnosed while it lasts: rank 1's dataloader worker sleeps
    12 s in batch 3 (rank 0 waits in the gradient all-reduce); rank 0 (the rank that writes
    checkpoints) sleeps 12 s in its first save, at step 4 (rank 1 waits in the save's barrier);
    then rank 0 sleeps for good in its training step 7 (rank 1 waits). Also --watch on the live
    run, and Ctrl-C on the hung run. (The checkpoint hang had a launch of its own before.)"""
    out = tmp_path / "run"
    logs = out / "logs"
    fault = (
        "sleep@data:rank=1:step=3:secs=12,sleep@checkpoint:rank=0:step=4:secs=12,"
        "sleep@train:rank=0:step=7:secs=3600"
    )
    console = tmp_path / "console.txt"
    args = [*shard_args(make_shards, 2), "--debug=true", "--checkpointing_period=4"]
    with live_run(args, out, fault, console) as run:
        wait_for("rank 1's data loading STALL report, with its workers' stacks", lambda: any(
            "dataloader workers" in p.read_text() for p in logs.glob("debug_rank1_*.log")
        ))  # fmt: skip
        doc, elapsed = diagnose_json(logs)
        assert culprits(doc) == [(1, "data loading", "data loading")], doc
        assert elapsed < LIVE_ANSWER_S
        evidence = [e["text"] for e in doc["culprits"][0]["evidence"]]
        assert "STALL detected" in evidence[0]
        assert any("in _injected_sleep" in t for t in evidence[1:])  # the worker's own stack
        assert doc["status"] == "hung" and {r["rank"] for r in doc["ranks"]} == {0, 1}

        def hung_in(phase: str) -> bool:
            """Rank 0 stalled in `phase`, rank 1 past its data hang and waiting again."""
            s0, s1 = stalls(logs, 0), stalls(logs, 1)
            mine = [s for s in s0 if s and s["phase"] == phase and s["collective"] == "no"]
            return bool(mine) and None in s1 and s1[-1] is not None and s1[-1]["phase"] == phase

        for phase in ("checkpoint save", "training step"):  # its second hang, then its third
            wait_for(f"rank 0's {phase} STALL and rank 1's wait", lambda p=phase: hung_in(p))
            doc, elapsed = diagnose_json(logs)
            assert culprits(doc) == [(0, phase, phase)], doc
            assert [(v["rank"], v["cause"]) for v in doc["victims"]] == [(1, "collective wait")]
            assert elapsed < LIVE_ANSWER_S
        ranks = {r["rank"]: r for r in doc["ranks"]}
        assert ranks[0]["alive"] is True and ranks[0]["state"] == "stalled"
        assert ranks[1]["state"] == "waiting" and ranks[1]["stall_reports"] >= 2

        res = subprocess.run(
            [sys.executable, "-m", "ae.diagnose", str(logs), "--watch", "--count=1"],
            cwd=ROOT, capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert res.returncode == 0, res.stderr
        assert re.search(r"STALL", res.stdout) and "training step" in res.stdout

        # Ctrl-C on the hung run: each rank leaves at once, saying where the signal found it,
        # and the console names the rank that held the job back, before the resume advice
        os.killpg(run.pid, signal.SIGINT)
        assert run.wait(timeout=90) == 130
    said = console.read_text()
    assert re.search(
        r"The job was stuck when stopped: rank 0 on \S+, phase training step: "
        r"training step \(no progress for \d+s\+ outside a collective\)",
        said,
    ), said
    last = said.rstrip().splitlines()[-1]
    assert "Interrupted before the ranks saved a checkpoint" in last, said
    stuck = {rank: stuck_in(logs, rank) for rank in (0, 1)}
    assert re.fullmatch(r"code: _injected_sleep \(\S*ae/forensics/faults\.py:\d+\)", stuck[0])
    assert stuck[1] == "collective: DDP gradient all-reduce in backward", stuck


def test_exception_on_one_rank(rank_1_raises_at_step_3: FinishedRun) -> None:
    res = rank_1_raises_at_step_3.result  # shard_args(make_shards, 1), the same run
    assert res.returncode != 0
    doc, _ = diagnose_json(res.logs)
    assert culprits(doc) == [(1, "training step", "exception: InjectedFault")], doc
    evidence = [e["text"] for e in doc["culprits"][0]["evidence"]]
    assert "FATAL uncaught exception InjectedFault" in evidence[0]
    assert evidence[-1] == "ae.forensics.faults.InjectedFault: raise fault injected by AE_FAULT"
    assert [v["rank"] for v in doc["victims"]] == [0] and doc["status"] == "failed"
    # The launcher's console: the same verdict, not torchrun's report (that is in a file).
    host = socket.gethostname()
    assert f"Training failed: rank 1 on {host}, phase training step: exception: InjectedFault" in (
        res.output
    )
    assert "FATAL uncaught exception InjectedFault" in res.output  # its evidence lines
    assert f"More: ae-diagnose {res.logs} --run {doc['run']}" in res.output
    assert "Once its cause is fixed, or to try again: " in res.output  # the way on
    assert "ChildFailedError" not in res.output and "Traceback" not in res.output
    assert "Connection closed by peer" not in res.output  # rank 0's FATAL: only in the logs
    assert "ChildFailedError" in res.text("launcher_*.log")


def test_rank_sigkilled_mid_epoch(make_shards, tmp_path: Path) -> None:
    res = run_launcher(
        [*shard_args(make_shards, 1), "--debug=true"],
        tmp_path / "run",
        env={"AE_FAULT": "kill@train:rank=0:step=6"},
    )
    assert res.returncode != 0
    doc, _ = diagnose_json(res.logs)
    assert culprits(doc) == [(0, "training step", "killed (SIGKILL)")], doc  # torchrun's report
    assert (
        "Training step" in doc["culprits"][0]["evidence"][0]["text"]
        or "FAULT injected" in (doc["culprits"][0]["evidence"][0]["text"])
    )
    assert doc["ranks"][0]["memory"].startswith("rss=")  # its last memory figure
    assert [v["rank"] for v in doc["victims"]] == [1]
