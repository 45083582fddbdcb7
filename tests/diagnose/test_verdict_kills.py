"""ae-diagnose verdict rules for ranks that ended without a trace: killed (its log just stops,
its process gone), stopped by torchrun or a SIGTERM after another rank's end, and torchrun's
report of who ended first (launcher_<TS>.log; or the launcher's own line, for a rank it started
itself); synthetic logs in the real line formats
(bench/synthetic_logs.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from ae.log_lines import (
    DEBUG_LOG_FILE,
    LAUNCHER_LOG_FILE,
    MARKER,
    RANK_ENDED,
    STOP_SIGNAL,
    STOP_SIGNAL_STUCK,
)
from bench.synthetic_logs import TS, RankWriter, write_heartbeat
from tests.diagnose.synthetic_runs import (
    BACKWARD_FRAMES,
    GLOO,
    STEP_FRAMES,
    culprits,
    dead_pid,
    run_diagnose,
    writers,
)


def test_killed_rank_whose_process_is_gone(tmp_path: Path) -> None:
    """Rank 0's log stops mid-epoch (SIGKILL, the OOM killer); rank 1 then fails on the closed
    connection: rank 0 is the culprit, rank 1 a victim."""
    w0, w1 = writers(tmp_path)
    for w in (w0, w1):
        w.log("========== EPOCH 0 TRAINING START ==========")
        w.steps(1, 5)
    write_heartbeat(tmp_path, 0, 2, pid=dead_pid(), t=w0.t, phase="training step", step=5)
    w1.steps(6, 6)
    w1.fatal("RuntimeError", GLOO, BACKWARD_FRAMES)
    w0.flush()
    w1.flush()
    doc = run_diagnose(tmp_path)
    assert culprits(doc) == [(0, "training step", "killed without trace")]
    texts = [e["text"] for e in doc["culprits"][0]["evidence"]]
    assert "Training step 5" in texts[0] and "is gone" in texts[-1]
    assert doc["ranks"][0]["alive"] is False and doc["ranks"][0]["state"] == "killed"
    assert doc["ranks"][0]["memory"] == "rss=400MB workers=1x300MB"
    assert [(v["rank"], v["cause"]) for v in doc["victims"]] == [(1, "peer failure: RuntimeError")]


def test_a_one_process_jobs_killed_rank_is_named_from_the_launchers_line(tmp_path: Path) -> None:
    """One process on one node has no torchrun: the launcher, its parent, says how it ended
    (`RANK_ENDED`), and the verdict names the signal, as from torchrun's report."""
    (w0,) = writers(tmp_path, world=1)
    w0.log("========== EPOCH 0 TRAINING START ==========")
    w0.steps(1, 5)
    pid = dead_pid()
    write_heartbeat(tmp_path, 0, 1, pid=pid, t=w0.t, phase="training step", step=5)
    w0.flush()
    line = RANK_ENDED.format(rank=0, pid=pid, code=-9)
    (tmp_path / LAUNCHER_LOG_FILE.format(ts=TS)).write_text(line + "\n")
    doc = run_diagnose(tmp_path)
    assert culprits(doc) == [(0, "training step", "killed (SIGKILL)")]
    assert doc["culprits"][0]["evidence"][-1]["text"] == line
    assert (doc["ranks"][0]["signal"], doc["status"]) == ("SIGKILL", "failed")


def test_killed_without_heartbeat_while_the_peer_failed(tmp_path: Path) -> None:
    """Rank 0 died before its first heartbeat: its host still comes from its log header."""
    w0, w1 = writers(tmp_path)
    w0.steps(1, 4)
    w1.steps(1, 4)
    w1.fatal("DistBackendError", "NCCL communicator was aborted", BACKWARD_FRAMES)
    w0.flush()
    w1.flush()
    doc = run_diagnose(tmp_path)
    assert [c[0::2] for c in culprits(doc)] == [(0, "killed without trace")]
    assert doc["culprits"][0]["host"] == "node0" and doc["ranks"][0]["host"] == "node0"


def test_rank_stopped_by_torchrun_after_a_peer_failed_is_a_victim(tmp_path: Path) -> None:
    w0, w1 = writers(tmp_path)
    w0.steps(1, 3)
    w1.steps(1, 3)
    w1.fatal("ValueError", "bad value", STEP_FRAMES)  # rank 0 then SIGTERMed: log just stops
    write_heartbeat(tmp_path, 0, 2, pid=dead_pid(), t=w1.t + 0.2, phase="training step", step=3)
    w0.flush()
    w1.flush()
    doc = run_diagnose(tmp_path)
    assert culprits(doc) == [(1, "training step", "exception: ValueError")]
    assert [(v["rank"], v["cause"]) for v in doc["victims"]] == [(0, "stopped after rank 1 failed")]


def test_sigterm_and_second_death_are_not_blamed(tmp_path: Path) -> None:
    """Rank 0 dies first without trace; rank 1 dies 2 s later; rank 2 got SIGTERM (Lightning logs
    it) and its dataloader worker died of it: only rank 0 is the culprit."""
    w0, w1, w2 = writers(tmp_path, 3)
    for w in (w0, w1, w2):
        w.steps(1, 4)
    w1.t = w0.t + 2
    w1.steps(5, 5)
    for w in (w0, w1):
        write_heartbeat(tmp_path, w.rank, 3, pid=dead_pid(), t=w.t, phase="training step", step=4)
    w2.t = w1.t + 3
    w2.log(STOP_SIGNAL.format(signal="SIGTERM", phase="training step", step=3))
    w2.fatal("RuntimeError", "DataLoader worker (pid 1525) is killed by signal: Terminated.",
             BACKWARD_FRAMES)  # fmt: skip
    for w in (w0, w1, w2):
        w.flush()
    doc = run_diagnose(tmp_path)
    assert [c[0::2] for c in culprits(doc)] == [(0, "killed without trace")]
    assert [(v["rank"], v["cause"]) for v in doc["victims"]] == [
        (1, "stopped after rank 0 died"),
        (2, "stopped by SIGTERM"),
    ]


def test_sigterm_to_every_rank_is_a_preemption_without_culprit(tmp_path: Path) -> None:
    for w in writers(tmp_path):
        w.steps(1, 4)
        w.log(STOP_SIGNAL.format(signal="SIGTERM", phase="training step", step=3))
        w.fatal("RuntimeError", "DataLoader worker (pid 9) is killed by signal: Terminated.",
                BACKWARD_FRAMES)  # fmt: skip
        w.flush()
    doc = run_diagnose(tmp_path)
    assert doc["culprits"] == [] and doc["status"] == "stopped"
    assert [v["cause"] for v in doc["victims"]] == ["stopped by SIGTERM"] * 2


def test_a_second_ctrl_c_is_a_stop_not_a_kill(tmp_path: Path) -> None:
    """Was: `FAILED, held back by rank 1: killed without trace` after a second Ctrl-C, which
    SIGKILLs every process while rank 1 is still on its way to its stop line; and rank 0
    `stopped by SIGTERM` quoting its SIGINT line. torchrun's log says it got the signal."""
    w0, w1 = writers(tmp_path)
    for w in (w0, w1):
        w.steps(1, 4)
    write_heartbeat(tmp_path, 1, 2, pid=dead_pid(), t=w1.t, phase="training step", step=4)
    w0.t = w1.t + 0.1
    w0.log(STOP_SIGNAL.format(signal="SIGINT", phase="training step", step=4))
    write_heartbeat(tmp_path, 0, 2, pid=dead_pid(), t=w0.t, phase="training step", step=4)
    w0.flush()
    w1.flush()
    doc = run_diagnose(tmp_path)
    assert [c[0::2] for c in culprits(doc)] == [(1, "killed without trace")]  # without torchrun's
    (tmp_path / LAUNCHER_LOG_FILE.format(ts=TS)).write_text(
        "W1128 02:14:25.221000 30279 /x/torch/distributed/elastic/agent/server/api.py:753] "
        "Received 2 death signal, shutting down workers\n"
    )
    doc = run_diagnose(tmp_path)
    assert doc["culprits"] == [] and doc["status"] == "stopped"
    assert [(v["rank"], v["cause"]) for v in doc["victims"]] == [
        (0, "stopped by SIGINT"),
        (1, "stopped with the job (torchrun got SIGINT)"),
    ]


def test_a_rank_gone_before_the_launcher_stopped_torchrun_stays_the_culprit(tmp_path: Path) -> None:
    """Another node's host lost (tests/e2e/test_multinode.py): its rank is gone without trace,
    and this node's launcher then SIGTERMs its torchrun, which says `Received 15 death signal`.
    That stop is the launcher's answer to the loss, not a second Ctrl-C: rank 1 is the culprit."""
    w0, w1 = writers(tmp_path)
    for w in (w0, w1):
        w.steps(1, 4)
    write_heartbeat(tmp_path, 1, 2, pid=dead_pid(), t=w1.t, phase="training step", step=4)
    w0.flush()
    w1.flush()
    (tmp_path / LAUNCHER_LOG_FILE.format(ts=TS)).write_text(
        "W1128 02:59:01.251000 22531 /x/torch/distributed/elastic/agent/server/api.py:753] "
        "Received 15 death signal, shutting down workers\n"
    )
    doc = run_diagnose(tmp_path)
    assert [c[0::2] for c in culprits(doc)] == [(1, "killed without trace")]


def test_checkpoint_and_sampling_markers_place_a_killed_rank(tmp_path: Path) -> None:
    """Markers are parsed by name (`CHECKPOINT SAVE START ========== step 4 ...` as the training
    recipe writes them): a rank killed inside a save is placed in `checkpoint save`."""
    w0, w1 = writers(tmp_path)
    for w in (w0, w1):
        w.steps(1, 4)
        w.log(MARKER.format(name="SAMPLING", edge="START") + " step 4: 1 batch(es)")
        w.log(MARKER.format(name="SAMPLING", edge="END") + " step 4: ok, 0.1s")
        w.log(MARKER.format(name="CHECKPOINT SAVE", edge="START") + " step 4 (periodic) -> /c")
    w1.t += 1
    w1.fatal("RuntimeError", GLOO, [("/x/torch/distributed/distributed_c10d.py", "barrier")])
    w0.flush()
    w1.flush()
    doc = run_diagnose(tmp_path)
    assert culprits(doc) == [(0, "checkpoint save", "killed without trace")]
    assert doc["ranks"][0]["last_marker"] == "CHECKPOINT SAVE START"


def _torchrun_report(logs: Path, first: tuple[int, int, int], then: tuple[int, int, int]) -> None:
    """launcher_<TS>.log with torchrun's report: (rank, exit code, pid) of its root cause (the
    first end it saw) and of a rank it stopped after."""
    blocks = []
    for title, (rank, code, pid) in (("Failures:", then), ("Root Cause (first observed failure):",
                                                            first)):  # fmt: skip
        sig = "  (SIGKILL)" if code == -9 else ""
        blocks += [title, "[0]:", f"  rank      : {rank} (local_rank: {rank})",
                   f"  exitcode  : {code} (pid: {pid}){sig}"]  # fmt: skip
    (logs / f"launcher_{TS}.log").write_text("\n".join(blocks) + "\n")


def _rank_1_stalls_rank_0_waits(logs: Path) -> tuple[RankWriter, RankWriter]:
    """Rank 1 stalls in its training step at step 3, rank 0 waits for it in the all-reduce."""
    w0, w1 = writers(logs)
    for w in (w0, w1):
        w.log("========== EPOCH 0 TRAINING START ==========")
        w.steps(1, 3)
    w1.stall("training step", 3, 3.1)
    w0.stall("training step", 3, 3.0, collective="yes (DDP gradient all-reduce in backward)",
             frame="_engine_run_backward (torch/autograd/graph.py:979)")  # fmt: skip
    return w0, w1


@pytest.mark.parametrize("killed_first", [True, False])
def test_a_rank_killed_while_stalled_is_killed(tmp_path: Path, killed_first: bool) -> None:
    """Rank 1 stalls in its training step (rank 0 waits), then dies of SIGKILL. As torchrun's
    first end, it is `killed (SIGKILL)`, the stall in the rule, alive/exit_code/signal in the
    JSON; killed by torchrun after another rank's end, the stall stays its cause."""
    w0, w1 = _rank_1_stalls_rank_0_waits(tmp_path)
    w0.flush()
    w1.flush()
    killed, stopped = (1, -9, 4_194_001), (0, 1, 4_194_000)
    _torchrun_report(tmp_path, *((killed, stopped) if killed_first else (stopped, killed)))
    doc = run_diagnose(tmp_path)
    ranks = {r["rank"]: r for r in doc["ranks"]}
    assert (ranks[1]["alive"], ranks[1]["exit_code"], ranks[1]["signal"]) == (
        False,
        None,
        "SIGKILL",
    )
    assert (ranks[0]["alive"], ranks[0]["exit_code"], ranks[0]["signal"]) == (False, 1, None)
    if killed_first:
        assert culprits(doc) == [(1, "training step", "killed (SIGKILL)")]
        (culprit,) = doc["culprits"]
        assert "before: training step (no progress" in culprit["rule"]
        assert culprit["evidence"][-1]["text"] == "exitcode  : -9 (pid: 4194001)  (SIGKILL)"
        assert ranks[1]["state"] == "killed" and doc["status"] == "failed"
    else:
        assert culprits(doc) == [(1, "training step", "training step")]


def test_a_peer_torchrun_stopped_without_a_line_is_a_victim_though_it_went_silent_first(
    tmp_path: Path,
) -> None:
    """Rank 1 SIGKILLed in its training step while rank 0 waits for it; torchrun then SIGTERMs
    rank 0, which ends before it writes a line. Rank 0's last line was 2 ms older than rank 1's
    (seen in CI, tests/e2e/test_kills.py): it was named `killed without trace` beside rank 1."""
    w0, w1 = writers(tmp_path)
    for w in (w0, w1):
        w.log("========== EPOCH 0 TRAINING START ==========")
        w.steps(1, 10)
    w1.t = w0.t + 0.002
    w1.log("FAULT injected: sleep@train at step 11 (rank 1)")
    for rank, w in enumerate((w0, w1)):
        write_heartbeat(tmp_path, rank, 2, pid=dead_pid(), t=w.t, phase="training step", step=11)
        w.flush()
    _torchrun_report(tmp_path, (1, -9, 4_194_001), (0, -15, 4_194_000))
    doc = run_diagnose(tmp_path)
    assert [c[0::2] for c in culprits(doc)] == [(1, "killed (SIGKILL)")]
    assert [(v["rank"], v["cause"]) for v in doc["victims"]] == [
        (0, "stopped by torchrun after rank 1 ended")
    ]


@pytest.mark.parametrize("victim_end", [-15, 1], ids=["sigterm", "exit_1"])
def test_a_killed_rank_is_first_though_torchrun_names_its_stopped_victim(
    tmp_path: Path, victim_end: int
) -> None:
    """Rank 1 stalls and is SIGKILLed; rank 0's all-reduce fails on the closed socket, its
    exception stamped a moment before torchrun noticed rank 1's end (whole seconds): torchrun's
    root cause is rank 0, ended by torchrun's SIGTERM, or by its own exit 1 when the exception
    came first (seen in CI, tests/e2e/test_kills.py). The killed rank is still the one named."""
    w0, w1 = _rank_1_stalls_rank_0_waits(tmp_path)
    w0.fatal("RuntimeError", GLOO, BACKWARD_FRAMES)
    w0.flush()
    w1.flush()
    _torchrun_report(tmp_path, (0, victim_end, 4_194_000), (1, -9, 4_194_001))
    doc = run_diagnose(tmp_path)
    assert culprits(doc) == [(1, "training step", "killed (SIGKILL)")]
    assert [v["rank"] for v in doc["victims"]] == [0]


def test_a_stalled_rank_that_left_on_a_stop_signal_keeps_its_stall(tmp_path: Path) -> None:
    """Torchrun's first end can be a stalled rank leaving on its SIGTERM (128 + 15, no exit
    line): it was stopped, so its stall stays the cause."""
    w0, w1 = writers(tmp_path)
    for w in (w0, w1):
        w.steps(1, 3)
    w1.stall("training step", 3, 3.1)
    w1.log(STOP_SIGNAL_STUCK.format(signal="SIGTERM", idle="20", phase="training step", step=3),
           "WARNING")  # fmt: skip
    w0.flush()
    w1.flush()
    _torchrun_report(tmp_path, (1, 143, 4_194_001), (0, 1, 4_194_000))
    doc = run_diagnose(tmp_path)
    assert culprits(doc) == [(1, "training step", "training step")]
    assert doc["ranks"][1]["exit_code"] == 143 and doc["ranks"][1]["signal"] is None


def test_a_peer_stopped_while_it_imported_is_a_victim_of_a_user_error(tmp_path: Path) -> None:
    """Rank 1 stops at setup on a user error (a damaged --perceptual_weights file: exit 2) while
    rank 0, slower on a busy CPU, still imports torch: torchrun SIGTERMs rank 0 before it writes
    its first line (an empty debug log). Rank 0 was named `killed without trace` beside rank 1,
    so the launcher said `Training failed` and exited 1 instead of giving the message, exit 2."""
    w1 = writers(tmp_path, world=2)[1]
    (tmp_path / DEBUG_LOG_FILE.format(rank=0, ts=TS)).write_text("")
    w1.log("perceptual_weights: w/vgg.pth is not a readable torch weights file", "ERROR")
    w1.exit(2, "WeightsFileError")
    w1.flush()
    _torchrun_report(tmp_path, (1, 2, 4_194_001), (0, -15, 4_194_000))
    doc = run_diagnose(tmp_path)
    assert [c[0::2] for c in culprits(doc)] == [(1, "error exit: WeightsFileError")]
    assert [(v["rank"], v["cause"]) for v in doc["victims"]] == [
        (0, "stopped by torchrun after rank 1 ended")
    ]


TORCHRUN_STARTED = "I1128 04:44:51.000000 27307 api.py:100] Starting elastic_operator\n"


@pytest.mark.parametrize("torchrun_saw_it", [False, True])
def test_a_job_killed_whole_names_no_rank_as_the_others_cause(
    tmp_path: Path, torchrun_saw_it: bool
) -> None:
    """Every process of the job SIGKILLed at once (kill -9 of all, the OOM killer): both logs
    stop at the same step within ms, both pids gone, and torchrun, killed too, wrote no end.
    Was: rank 0 `stopped after rank 1 died`, of a death it had nothing to do with (found by the
    overnight walkthrough). When torchrun saw rank 1 end first, rank 1 is the cause as before."""
    w0, w1 = writers(tmp_path)
    for w in (w0, w1):
        w.steps(1, 9)
    w0.t = w1.t + 0.007
    for w in (w1, w0):
        w.flush()
        write_heartbeat(tmp_path, w.rank, 2, pid=dead_pid(), t=w.t, phase="training step", step=9)
    report = TORCHRUN_STARTED
    if torchrun_saw_it:
        report += (
            "Root Cause (first observed failure):\n"
            "  rank      : 1 (local_rank: 1)\n"
            "  exitcode  : -9 (pid: 4242)\n"
        )
    (tmp_path / LAUNCHER_LOG_FILE.format(ts=TS)).write_text(report)
    doc = run_diagnose(tmp_path)
    [culprit] = doc["culprits"]
    assert (culprit["rank"], culprit["cause"]) == (1, "killed without trace" if not torchrun_saw_it
                                                   else "killed (SIGKILL)")  # fmt: skip
    together = "every process of the job was killed at once"
    if torchrun_saw_it:
        assert together not in culprit["rule"]
        assert [(v["rank"], v["cause"]) for v in doc["victims"]] == [
            (0, "stopped after rank 1 died")
        ]
    else:
        assert (
            f"rank 0 stopped with it and torchrun's log names no end: {together}"
            in (culprit["rule"])
        )
        assert [(v["rank"], v["cause"]) for v in doc["victims"]] == [
            (0, "killed with the job, as rank 1")
        ]
