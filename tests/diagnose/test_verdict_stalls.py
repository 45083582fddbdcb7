"""ae-diagnose verdict rules for runs that stopped progressing: the stalled rank against the
ranks that wait for it in a collective, stalls that resolved, a watchdog that could not
report, a live healthy run, and every rank waiting across hosts (the network); synthetic logs
in the real line formats (bench/synthetic_logs.py)."""

from __future__ import annotations

import os
import time
from pathlib import Path

import psutil
import pytest

from ae.log_lines import STALL_ENDED, STOP_SIGNAL, STOP_SIGNAL_STUCK, STUCK_MAIN_THREAD
from bench.synthetic_logs import write_heartbeat, write_train_log
from tests.diagnose.synthetic_runs import (
    BACKWARD_FRAMES,
    GLOO,
    culprits,
    dead_pid,
    run_diagnose,
    writers,
)


def test_a_stall_its_watchdog_could_not_report_is_not_a_silent_kill(tmp_path: Path) -> None:
    """The rank deadlocks (a lock that its watchdog thread needs too: seen on a GPU node, where
    Python 3.12's fork warning met loguru's at-fork locks), the watchdog marks the heartbeat
    stalled but never writes its STALL line; faulthandler's timer dumps every thread. Then the
    job is stopped. The verdict names the stall and the main thread's innermost frame."""
    (w0,) = writers(tmp_path, world=1)
    w0.log("========== EPOCH 0 TRAINING START ==========")
    w0.raw(
        "Timeout (0:00:27)!",
        "Thread 0x00007f1f8bc856c0 (most recent call first):",
        '  File "/site/loguru/_handler.py", line 122 in _protected_lock',
        '  File "/x/ae/forensics/watchdog.py", line 129 in _report',
        "",
        "Thread 0x00007f20bc4f1140 (most recent call first):",
        '  File "/site/loguru/_handler.py", line 122 in _protected_lock',
        '  File "/usr/lib/python3.12/multiprocessing/popen_fork.py", line 66 in _launch',
    )
    w0.flush()
    write_heartbeat(tmp_path, 0, 1, pid=dead_pid(), t=w0.t + 27, phase="data loading", step=0,
                    stalled=True)  # fmt: skip
    doc = run_diagnose(tmp_path)
    assert culprits(doc) == [(0, "data loading", "stalled, watchdog blocked")]
    texts = [e["text"] for e in doc["culprits"][0]["evidence"]]
    assert texts[-2] == "Timeout (0:00:27)!"
    assert "line 122 in _protected_lock" in texts[-1]
    lines = w0.path.read_text().splitlines()
    main_thread = lines.index("Thread 0x00007f20bc4f1140 (most recent call first):")
    assert doc["culprits"][0]["evidence"][-1]["line"] == main_thread + 2  # not the watchdog's


def test_stall_outside_a_collective_is_the_culprit_waiters_are_victims(tmp_path: Path) -> None:
    w0, w1 = writers(tmp_path)
    for w in (w0, w1):
        w.log("========== EPOCH 0 TRAINING START ==========")
        w.steps(1, 3)
    w1.stall("data loading", 3, 3.1, frame="_recv (multiprocessing/connection.py:430)",
             worker_frame="_injected_sleep")  # fmt: skip
    w0.stall("training step", 4, 3.0, collective="yes (DDP gradient all-reduce in backward)",
             frame="_engine_run_backward (torch/autograd/graph.py:979)")  # fmt: skip
    w0.flush()
    w1.flush()
    doc = run_diagnose(tmp_path)
    assert culprits(doc) == [(1, "data loading", "data loading")]
    texts = [e["text"] for e in doc["culprits"][0]["evidence"]]
    assert "STALL detected" in texts[0] and texts[1].endswith("line 120 in _injected_sleep")
    assert len(texts) == 2  # the idle worker is left out
    assert [(v["rank"], v["phase"], v["cause"]) for v in doc["victims"]] == [
        (0, "training step", "collective wait")
    ]
    assert doc["status"] == "hung"
    assert [r["stall_reports"] for r in doc["ranks"]] == [1, 1]


def test_repeated_and_resolved_stalls(tmp_path: Path) -> None:
    w0, w1 = writers(tmp_path)
    w1.stall("data loading", 3, 3.0, report=1)
    w1.stall("data loading", 3, 6.0, report=2)
    w1.resolved("data loading", 3, 8.0)
    w1.steps(4, 6)
    w0.t = w1.t - 0.3
    w0.steps(1, 6)
    w0.flush()
    w1.flush()
    doc = run_diagnose(tmp_path)
    assert doc["culprits"] == [] and doc["ranks"][1]["stall_reports"] == 2
    assert doc["ranks"][1]["state"] == "running"


@pytest.mark.parametrize("case", ["missing", "behind", "quiet", "all"])
def test_every_stalled_rank_waits(tmp_path: Path, case: str) -> None:
    world = 3
    ws = writers(tmp_path, world)
    yes = "yes (barrier)"
    if case == "missing":
        ws[2].path.unlink(missing_ok=True)
        ws = ws[:2]
    steps = {"behind": [5, 5, 4]}.get(case, [5, 5, 5])
    for w, step in zip(ws, steps, strict=False):
        if case == "quiet" and w.rank == 2:
            w.steps(1, step)  # no STALL of its own: its watchdog could not run
            w.raw("Timeout (0:00:05)!", "Thread 0x00007f01 (most recent call first):")
            continue
        w.stall("checkpoint save", step, 3.0, collective=yes)
    for w in ws:
        w.flush()
    doc = run_diagnose(tmp_path)
    if case == "missing":
        assert culprits(doc) == [(2, None, "missing log")] and doc["missing_ranks"] == [2]
    elif case == "behind":
        assert culprits(doc) == [(2, "checkpoint save", "collective wait")]
        assert "behind" in doc["culprits"][0]["rule"]
    elif case == "quiet":
        assert [c[0] for c in culprits(doc)] == [2]
        assert doc["culprits"][0]["evidence"][-1]["text"] == "Timeout (0:00:05)!"
    else:
        assert [c[2] for c in culprits(doc)] == ["collective wait"] * 3


def test_no_stall_reports_the_first_rank_to_stop_progressing(tmp_path: Path) -> None:
    """Watchdog off or not due yet: heartbeats and log times say who stopped first."""
    now = time.time()
    w0, w1 = writers(tmp_path, t=now - 400)
    for w in (w0, w1):
        w.log("========== EPOCH 0 TRAINING START ==========")
        w.steps(1, 3)
    w1.steps(4, 4)
    w0.flush()
    w1.flush()
    write_train_log(tmp_path, 2, stall_timeout=300.0)
    me = os.getpid()
    write_heartbeat(tmp_path, 0, 2, pid=me, t=now, phase="data loading", step=3,
                    last_progress=w0.t)  # fmt: skip
    write_heartbeat(tmp_path, 1, 2, pid=me, t=now, phase="training step", step=4,
                    last_progress=w1.t)  # fmt: skip
    doc = run_diagnose(tmp_path)
    assert culprits(doc) == [(0, "data loading", "data loading")]
    assert doc["ranks"][0]["alive"] is True and doc["status"] == "hung"
    assert [(v["rank"], v["cause"]) for v in doc["victims"]] == [(1, "no progress (waiting?)")]


def test_live_healthy_run_has_no_culprit(tmp_path: Path) -> None:
    now = time.time()
    for w in writers(tmp_path, t=now - 5):
        w.steps(1, 10, dt=0.1)
        w.flush()
        write_heartbeat(tmp_path, w.rank, 2, pid=os.getpid(), t=now, phase="training step", step=10)
    doc = run_diagnose(tmp_path)
    assert doc["culprits"] == [] and doc["status"] == "running"


def test_stuck_rank_stays_the_culprit_after_its_peer_times_out_and_torchrun_stops_it(
    tmp_path: Path,
) -> None:
    """--pg_timeout: rank 1 is stuck in its step, rank 0 waits, then fails on the collective
    timeout; torchrun SIGTERMs rank 1, whose stall 'resolves' into teardown on the way out."""
    w0, w1 = writers(tmp_path)
    w1.stall("training step", 11, 3.0)
    w0.stall("training step", 11, 3.2, collective="yes (DDP gradient all-reduce in backward)")
    w0.t += 9
    w0.fatal("RuntimeError", "[gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 12000ms "
             "for recv operation to complete", BACKWARD_FRAMES)  # fmt: skip
    w1.t = w0.t + 1
    w1.log(STOP_SIGNAL_STUCK.format(signal="SIGTERM", idle=14, phase="training step", step=11))
    w1.resolved("training step", 11, 14.0, now="phase teardown, step 11")
    w1.fatal("RuntimeError", GLOO, BACKWARD_FRAMES)
    w0.flush()
    w1.flush()
    doc = run_diagnose(tmp_path)
    assert culprits(doc) == [(1, "training step", "training step")]
    assert [(v["rank"], v["cause"]) for v in doc["victims"]] == [(0, "peer failure: RuntimeError")]


def test_every_rank_waiting_across_hosts_is_the_network(tmp_path: Path) -> None:
    """A link that drops: both ranks, on two hosts, stall in the gradient all-reduce at the same
    step, then fail on the collective timeout. No rank is stuck in its own work: the verdict
    names the hosts, not the first rank whose timeout fired."""
    w0, w1 = writers(tmp_path)
    waiting = "yes (DDP gradient all-reduce in backward)"
    for w, host in ((w0, "node0"), (w1, "node1")):
        w.stall("training step", 127, 3.5, collective=waiting)
        w.t += 20
        w.fatal("RuntimeError", GLOO, BACKWARD_FRAMES)
        w.flush()
        write_heartbeat(tmp_path, w.rank, 2, pid=99999990 + w.rank, t=w.t, host=host,
                        phase="training step", step=127, state="failed", stalled=True)  # fmt: skip
    doc = run_diagnose(tmp_path)
    assert doc["culprits"] == [] and doc["status"] == "failed"
    assert doc["network"]["hosts"] == ["node0", "node1"] and doc["network"]["step"] == 127
    assert doc["network"]["cause"] == "network: hosts node0 and node1 cannot reach each other"
    assert [(v["rank"], v["host"], v["cause"]) for v in doc["victims"]] == [
        (0, "node0", "collective wait (network)"),
        (1, "node1", "collective wait (network)"),
    ]
    # the same logs on ONE host: the old rule (the first rank to fail) still applies
    for rank in (0, 1):
        write_heartbeat(tmp_path, rank, 2, pid=99999990 + rank, t=w1.t, host="node0",
                        phase="training step", step=127, state="failed", stalled=True)  # fmt: skip
    doc = run_diagnose(tmp_path)
    assert doc["network"] is None and len(doc["culprits"]) == 1


@pytest.mark.parametrize("gone", [False, True], ids=["live", "processes_gone"])
def test_a_hang_whose_processes_are_all_gone_reads_stopped_not_hung(
    tmp_path: Path, gone: bool
) -> None:
    """Rank 1 stalls in its own step, rank 0 waits for it: hung while their processes live.
    Stopped with Ctrl-C (rank 1 left on the stop signal, rank 0's pid gone): `stopped`, the
    stall still the verdict."""
    w0, w1 = writers(tmp_path)
    for w in (w0, w1):
        w.steps(1, 3)
    w1.stall("training step", 3, 3.1)
    w0.stall("training step", 3, 3.0, collective="yes (DDP gradient all-reduce in backward)",
             frame="_engine_run_backward (torch/autograd/graph.py:979)")  # fmt: skip
    if gone:
        w1.log(STOP_SIGNAL_STUCK.format(signal="SIGINT", idle="12", phase="training step",
                                        step=3), "WARNING")  # fmt: skip
    w0.flush()
    w1.flush()
    pid = dead_pid() if gone else os.getpid()
    # Not before this process started: a pid younger than its heartbeat is another process.
    beat = max(time.time() - 5, psutil.Process().create_time() + 1)
    for rank in (0, 1):
        write_heartbeat(tmp_path, rank, 2, pid=pid, t=beat, phase="training step",
                        step=3, stalled=True)  # fmt: skip
    doc = run_diagnose(tmp_path)
    assert culprits(doc) == [(1, "training step", "training step")]
    assert doc["status"] == ("stopped" if gone else "hung")


def test_a_hang_stopped_before_any_stall_names_the_rank_stuck_in_its_own_work(
    tmp_path: Path,
) -> None:
    """Ctrl-C 40 s into a hang, long before a STALL report (--stall_timeout 300): the stop signal
    found rank 1 in its own code and rank 0 waiting for it in the gradient all-reduce; each left
    at once, saying where its main thread was. Rank 1 held the job back (was: `no rank holds the
    job back`, both ranks victims of the Ctrl-C); the run is stopped, not hung."""
    w0, w1 = writers(tmp_path)
    for w in (w0, w1):
        w.steps(1, 5)
    stuck = {
        1: "code: forward (my_model.py:12)",
        0: "collective: DDP gradient all-reduce in backward",
    }
    for w in (w1, w0):  # rank 1 leaves first: rank 0's all-reduce then fails, and it leaves too
        w.t += 40
        line = STOP_SIGNAL_STUCK.format(signal="SIGINT", idle=40, phase="training step", step=5)
        w.log(line + STUCK_MAIN_THREAD.format(doing=stuck[w.rank]), "WARNING")
        w.log(STOP_SIGNAL.format(signal="SIGINT", phase="training step", step=5), "WARNING")
        w.flush()
        write_heartbeat(tmp_path, w.rank, 2, pid=dead_pid(), t=w.t, phase="training step", step=5)
    doc = run_diagnose(tmp_path)
    assert culprits(doc) == [(1, "training step", "training step")]
    (culprit,) = doc["culprits"]
    assert culprit["rule"] == (
        "no progress for 40s when SIGINT came, main thread in code: forward (my_model.py:12)"
    )
    assert "stuck in code: forward" in culprit["evidence"][0]["text"]
    assert [(v["rank"], v["cause"]) for v in doc["victims"]] == [(0, "stopped by SIGINT")]
    assert doc["status"] == "stopped"


def test_a_stall_that_goes_on_in_teardown_after_ctrl_c_keeps_its_phase(tmp_path: Path) -> None:
    """README's hang (`AE_FAULT=sleep@data:rank=1`, `--stall_timeout=5`), then Ctrl-C: rank 1's
    handler leaves its data-loading stall for teardown, where it waits on the same sleeping
    worker and its watchdog reports a new STALL in phase `teardown`. The verdict names what
    held the job back, data loading (was: `rank 1 on vm, phase teardown: teardown`)."""
    w0, w1 = writers(tmp_path)
    for w in (w0, w1):
        w.steps(1, 3)
    w1.stall("data loading", 3, 5.4)
    w0.stall("training step", 3, 5.2, collective="yes (DDP gradient all-reduce in backward)")
    w0.flush()
    w1.t += 20
    w1.log(STOP_SIGNAL.format(signal="SIGINT", phase="data loading", step=3), "WARNING")
    ended = STALL_ENDED.format(idle=28.8, phase="data loading", epoch=0, step=3,
                               why="stop signal SIGINT")  # fmt: skip
    w1.log(ended)
    w1.stall("teardown", 3, 5.9, report=4, frame="select (selectors.py:415)")
    w1.t += 4
    line = STOP_SIGNAL_STUCK.format(signal="SIGINT", idle=29, phase="data loading", step=3)
    w1.log(line + STUCK_MAIN_THREAD.format(doing="data loading"), "WARNING")
    w1.flush()
    doc = run_diagnose(tmp_path)
    assert culprits(doc) == [(1, "data loading", "data loading")]


@pytest.mark.parametrize(("ahead", "network"), [(1, True), (2, False)])
def test_a_link_that_drops_mid_collective_leaves_one_rank_a_step_on(
    tmp_path: Path, ahead: int, network: bool
) -> None:
    """Seen in a fresh-clone run of test_link_down: rank 1's side of step 29's all-reduce
    completed before the link dropped, and it stalled in step 30's first collective (Lightning's
    broadcast), rank 0 still in step 29's: the network all the same. Ranks two steps apart are
    not one collective cut in two."""
    w0, w1 = writers(tmp_path)
    for w, host, step, phase, waiting in (
        (w0, "node0", 29, "training step", "yes (DDP gradient all-reduce in backward)"),
        (w1, "node1", 29 + ahead, "data loading", "yes (broadcast)"),
    ):
        w.stall(phase, step, 3.5, collective=waiting)
        w.t += 20
        w.fatal("RuntimeError", GLOO, BACKWARD_FRAMES)
        w.flush()
        write_heartbeat(tmp_path, w.rank, 2, pid=99999990 + w.rank, t=w.t, host=host,
                        phase=phase, step=step, state="failed", stalled=True)  # fmt: skip
    doc = run_diagnose(tmp_path)
    if network:
        assert doc["culprits"] == [] and doc["network"]["step"] == 29
    else:
        assert doc["network"] is None


@pytest.mark.parametrize("progress", [False, True], ids=["same_step", "a_step_later"])
def test_a_broadcast_that_returns_at_its_timeout_then_a_closed_pair_is_the_network(
    tmp_path: Path, progress: bool
) -> None:
    """Seen in test_link_down: the link dropped while both ranks waited in step 11's broadcast.
    Rank 1's broadcast returned at --pg_timeout (`STALL RESOLVED ... now phase training step,
    step 11`), and its all-reduce of the same step failed on the closed pair; rank 0's stall
    stayed open. The verdict blamed rank 1 (`exited 1`): it is the network. A rank that made a
    step's progress after its wait ended (step 12) has no such excuse."""
    w0, w1 = writers(tmp_path)
    closed = "Application timeout caused pair closure"
    for w, host in ((w0, "node0"), (w1, "node1")):
        w.stall("data loading", 11, 3.5, collective="yes (broadcast)")
        w.t += 5
        step = 11
        if w is w1:
            step = 12 if progress else 11
            w.resolved("data loading", 11, 8.0, now=f"phase training step, step {step}")
        w.t += 0.2
        w.fatal("RuntimeError", closed, BACKWARD_FRAMES)
        w.flush()
        write_heartbeat(tmp_path, w.rank, 2, pid=99999990 + w.rank, t=w.t, host=host,
                        phase="training step", step=step, state="failed",
                        stalled=w is w0)  # fmt: skip
    doc = run_diagnose(tmp_path)
    if progress:
        assert doc["network"] is None
        return
    assert doc["culprits"] == [] and doc["status"] == "failed", doc["culprits"]
    assert doc["network"]["hosts"] == ["node0", "node1"] and doc["network"]["step"] == 11
    assert [(v["rank"], v["cause"]) for v in doc["victims"]] == [
        (0, "collective wait (network)"),
        (1, "collective wait (network)"),
    ]
