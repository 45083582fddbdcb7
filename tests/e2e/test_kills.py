"""Rank 1 SIGKILLed from outside (what the OOM killer or a user's `kill -9` does), at several
moments: every verdict -- the launcher's console, `ae-diagnose`, `--json` -- names rank 1 killed
by SIGKILL, and its orphaned dataloader worker writes no FATAL line (issue 30). One killed while
it stalled also shows --watch naming the culprit of the live hang, then rank 1 dead.

Each kill is one short launch (tiny vector shards, one worker per rank), two at a time."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from ae.data.shards.writer import write_shard
from tests.support.live import diagnose, diagnose_json, wait_for
from tests.support.runs import ROOT, SERIAL, run_processes
from tests.support.shards import vector_samples

pytestmark = [pytest.mark.slow, SERIAL]  # kills at a moment; stall timeouts

KILLED = "killed (SIGKILL)"


def _args(make_shards, out: Path, epochs: int = 1, stall_timeout: float = 60) -> list[str]:
    train = make_shards([80, 80, 80], name="train")  # 15 batches of 8 per rank and epoch
    val = make_shards([16], name="val")
    return [sys.executable, "-m", "ae.cli.launch", f"--output_dir={out}",
            f"--train_shards={train}", f"--val_shards={val}", "--batch_size=8",
            f"--max_epochs={epochs}", "--num_workers=1", f"--stall_timeout={stall_timeout}",
            "--debug=true"]  # fmt: skip


def _start(cmd: list[str], out: Path, fault: str) -> tuple[subprocess.Popen, Path]:
    env = {k: v for k, v in os.environ.items() if k not in ("AE_RUN_TS", "MASTER_PORT")}
    env.update(AE_CACHE_DIR=str(out.parent / "cache"), AE_FAULT=fault)
    console = out.parent / f"{out.name}.console.txt"
    with console.open("w") as sink:
        proc = subprocess.Popen(
            cmd, cwd=ROOT, env=env, stdout=sink, stderr=subprocess.STDOUT,
            start_new_session=True,
        )  # fmt: skip
    return proc, console


def _rank_log(logs: Path, rank: int) -> str:
    return "".join(p.read_text(errors="replace") for p in logs.glob(f"debug_rank{rank}_*.log"))


def _pid(logs: Path, rank: int) -> int | None:
    for path in logs.glob(f"heartbeat_rank{rank}_*.json"):
        try:
            return int(json.loads(path.read_text())["pid"])
        except (OSError, ValueError, KeyError):
            return None
    return None


def _finish(proc: subprocess.Popen, out: Path) -> None:
    """The launcher's end, then its orphans' (rank 1's worker wakes and leaves on its own)."""
    proc.wait(timeout=120)
    end = time.monotonic() + 30
    while (left := run_processes(out)) and time.monotonic() < end:
        time.sleep(0.2)
    for p in left:
        p.kill()
    assert not left, f"processes outlived the run: {left}"


def _assert_killed(out: Path, console: Path, moment: str) -> dict[str, Any]:
    logs = out / "logs"
    text = console.read_text()
    host = socket.gethostname()
    assert re.search(
        rf"Training failed: rank 1 on {host}, phase [^:]+: {re.escape(KILLED)}", text
    ), (
        moment,
        text,
    )
    # rank 0's stall in the step ended because its peer died, not because it went on (with
    # --stall_timeout=2 a loaded machine's setup may stall and resolve first: that one may)
    assert not re.search(r"STALL RESOLVED .* in phase (training step|validation)", text), text
    assert f"rank 1 on {host}: {KILLED}" in diagnose(logs)
    doc = diagnose_json(logs)
    assert [(c["rank"], c["cause"]) for c in doc["culprits"]] == [(1, KILLED)], (moment, doc)
    rank1 = doc["ranks"][1]
    assert (rank1["alive"], rank1["exit_code"], rank1["signal"]) == (False, None, "SIGKILL")
    assert rank1["state"] == "killed"
    worker_fatal = [
        line for line in _rank_log(logs, 1).splitlines() if "Worker" in line and "FATAL" in line
    ]
    assert worker_fatal == [], moment
    return doc


def _kill_rank_1(logs: Path, ready: Callable[[], bool]) -> None:
    wait_for("the moment to kill rank 1", lambda: ready() and _pid(logs, 1))
    pid = _pid(logs, 1)
    assert pid is not None
    os.kill(pid, signal.SIGKILL)


def _has(logs: Path, text: str) -> Callable[[], bool]:
    return lambda: text in _rank_log(logs, 1)


GROUP = 2  # runs side by side
# (moment, AE_FAULT, epochs, what rank 1's log shows when it is killed)
# Late in an epoch, mid-batch in a worker, at the first and the last epoch's end; early in an
# epoch (in training step 3) is test_rank_killed_while_stalled's kill. (Nine moments once: three
# of each kind; the ones between added no path of their own, and each launch costs ~14 CPU s of
# the suite's time. The kill in training step 2 went too: the stalled run's kill in step 3 makes
# its every assertion.)
MOMENTS = [
    ("in training step 11", "sleep@train:rank=1:step=11:secs=30", 1,
     "FAULT injected: sleep@train"),
    ("worker mid-batch 7", "sleep@data:rank=1:step=7:secs=2", 1, "FAULT injected: sleep@data"),
    *[(f"epoch boundary {e}", "", 3, f"EPOCH {e} TRAINING END") for e in (0, 2)],
]  # fmt: skip


def test_rank_1_sigkilled_at_four_moments(make_shards, tmp_path: Path) -> None:
    """Four kills (with the one below, early in an epoch, five): late in a step, while its worker
    sleeps mid-batch, at an epoch's end. Two runs at a time side by side (a run mostly waits: for
    its imports, for torchrun): on a 2-core machine nine such runs took 81 s (166 s while it was
    busy with other work, 272 s one by one then), the killed-while-stalled run 12 s."""
    for group in range(0, len(MOMENTS), GROUP):
        runs = []
        try:
            for i, (moment, fault, epochs, ready) in enumerate(MOMENTS[group : group + GROUP]):
                out = tmp_path / f"run{group + i}"
                proc, console = _start(_args(make_shards, out, epochs), out, fault)
                runs.append((moment, out, proc, console, _has(out / "logs", ready)))
            waiting = list(runs)
            end = time.monotonic() + 120
            while waiting:
                assert time.monotonic() < end, f"never ready: {[w[0] for w in waiting]}"
                for run in list(waiting):
                    logs, ready = run[1] / "logs", run[4]
                    if ready() and (pid := _pid(logs, 1)) is not None:
                        os.kill(pid, signal.SIGKILL)
                        waiting.remove(run)
                time.sleep(0.05)
            for _, out, proc, _, _ in runs:
                _finish(proc, out)
        finally:
            for _, out, *_ in runs:
                for p in run_processes(out):
                    p.kill()
        for moment, out, _, console, _ in runs:
            doc = _assert_killed(out, console, moment)
            assert [v["rank"] for v in doc["victims"]] == [0], moment
            if "worker" in moment:
                # It woke after its rank died, and left quietly (or torch's own check ended it).
                log = _rank_log(out / "logs", 1)
                assert "FATAL" not in log and "Traceback" not in log, moment


def test_rank_killed_while_stalled(make_shards, tmp_path: Path) -> None:
    """Rank 1 reads a bad sample, then stalls in its training step 3 (rank 0 waits in the
    gradient all-reduce): the launcher's console says rank 1's error and STALL line; --watch
    names rank 1 the culprit, with what each main thread is in; then rank 1 is SIGKILLed: it is
    `killed (SIGKILL)` everywhere (not a hang), rank 0 its victim, and --watch shows it dead and
    ends. Also the kill early in an epoch, in a training step, of the moments above."""
    out = tmp_path / "run"
    logs = out / "logs"
    args = _args(make_shards, out, stall_timeout=2)
    # A sample that does not decode, in the shard only rank 1 reads in epoch 0 (the plan of 3
    # shards of 80 on 2 ranks: rank 1 has train-000000 whole and half of train-000001).
    shard = tmp_path / "shards" / "train-000000.tar"
    samples = vector_samples(80, 16)
    samples[2]["npy"] = b"\x93NUMPY broken"
    write_shard(shard, samples)
    proc, console = _start(args, out, "sleep@train:rank=1:step=3:secs=600")
    try:
        wait_for("rank 0 waiting, rank 1 stalled", lambda: (
            "collective wait: yes" in "".join(p.read_text() for p in logs.glob("debug_rank0_*"))
            and "STALL detected" in _rank_log(logs, 1)
        ))  # fmt: skip
        live = diagnose(logs, "--watch", "--count=1")
        row = {int(m[1]): m[0] for m in re.finditer(r"^│\s+(\d) .*$", live, re.M)}
        assert "CULPRIT: training step" in row[1] and "code: _injected_sleep" in row[1], live
        assert "collective: DDP gradient all-reduce" in row[0] and "CULPRIT" not in row[0], live
        watcher = subprocess.Popen(
            [sys.executable, "-m", "ae.diagnose", str(logs), "--watch", "--interval=0.5"],
            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        time.sleep(1.0)  # a refresh or two of the live hang first
        _kill_rank_1(logs, lambda: True)
        _finish(proc, out)
        watched, err = watcher.communicate(timeout=30)  # ends by itself: every rank ended
        assert watcher.returncode == 0, err
    finally:
        for p in run_processes(out):
            p.kill()
    frames = watched.split("ae-diagnose --watch")
    assert len(frames) >= 2
    last = {int(m[1]): m[0] for m in re.finditer(r"^│\s+(\d) .*$", frames[-1], re.M)}
    # Dead within a refresh (its pid gone; the signal too once torchrun has written it).
    assert re.search(r"│ dead(: killed \(SIGKILL\))? +│", last[1]), watched
    assert "CULPRIT" in last[1] and "CULPRIT" not in last[0], watched
    doc = _assert_killed(out, console, "while stalled")
    assert [v["rank"] for v in doc["victims"]] == [0], doc
    # The console spoke for rank 1: its worker's data error, and its own STALL line (the
    # culprit's; rank 0's console line is its collective wait).
    text = console.read_text()
    bad = f"rank 1 worker 0: Bad sample 00000002 in shard {shard}: cannot decode .npy"
    assert bad in text and "rank 0 worker" not in text, text
    assert re.search(r"rank 1: STALL detected: .* phase training step .*collective wait: no", text)
    assert "Bad sample" not in _rank_log(logs, 0)  # only rank 1 read it
    assert "training step" in doc["culprits"][0]["rule"]  # the stall it had first
