"""ae-diagnose verdict rules, one test per heuristic, on synthetic logs written with the real
line formats (bench/synthetic_logs.py)."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path
from typing import Any

import psutil
import pytest
from rich.console import Console

from ae.diagnose.log_files import find_run
from ae.diagnose.report import diagnose, render
from ae.log_lines import (
    FAULT_INJECTED,
    MARKER,
    NONFINITE,
    NONFINITE_INPUT,
    PREEMPTED,
    STOP_SIGNAL,
    STOP_SIGNAL_STUCK,
)
from bench.synthetic_logs import TS, RankWriter, write_heartbeat, write_train_log

GLOO = (
    "[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer "
    "[127.0.0.1]:54927. This is typically caused by a remote worker crashing."
)
STEP_FRAMES = [("/x/train_ae.py", "main"), ("/x/ae/training/model.py", "training_step"),
               ("/x/ae/forensics/faults.py", "_injected_raise")]  # fmt: skip
BACKWARD_FRAMES = [("/x/train_ae.py", "main"),
                   ("/x/torch/autograd/graph.py", "_engine_run_backward")]  # fmt: skip
SEGV_FRAMES = [("/x/ae/forensics/faults.py", "_injected_segv"),
               ("/x/ae/training/model.py", "training_step")]  # fmt: skip


def dead_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def run_diagnose(logs: Path) -> dict[str, Any]:
    return diagnose(find_run(logs))


def culprits(doc: dict[str, Any]) -> list[tuple[int, str | None, str]]:
    return [(c["rank"], c["phase"], c["cause"]) for c in doc["culprits"]]


def writers(logs: Path, world: int = 2, t: float | None = None) -> list[RankWriter]:
    write_train_log(logs, world)
    out = []
    for rank in range(world):
        w = RankWriter(logs, rank, world) if t is None else RankWriter(logs, rank, world, t=t)
        w.start()
        out.append(w)
    return out


def test_clean_run_has_no_culprit(tmp_path: Path) -> None:
    for w in writers(tmp_path):
        w.epoch(0, 1, 15)
        w.epoch(1, 16, 30)
        w.exit()
        w.flush()
    doc = run_diagnose(tmp_path)
    assert doc["culprits"] == [] and doc["victims"] == [] and doc["status"] == "finished"
    assert doc["stopped_by"] is None
    assert [(r["rank"], r["state"], r["step"]) for r in doc["ranks"]] == [
        (0, "exited", 30),
        (1, "exited", 30),
    ]
    assert doc["ranks"][0]["last_marker"] == "EPOCH 1 VALIDATION END"
    assert doc["ranks"][0]["memory"] == "rss=400MB workers=1x300MB"


def test_a_run_stopped_by_a_signal_after_its_save_is_stopped_not_finished(tmp_path, capsys):
    """Ctrl-C, scancel, a preemption: every rank saves and exits 0, but training did not end."""
    ckpt = "/runs/ae/checkpoints/step-00000020.ckpt"
    for w in writers(tmp_path):
        w.epoch(0, 1, 15)
        w.steps(16, 20, epoch=1)
        w.log(PREEMPTED.format(signal="SIGINT", step=20, path=ckpt, lr=0.001), "WARNING")
        w.exit(why="preempted at step 20; resume with --resume_from_checkpoint=last")
        w.flush()
    doc = run_diagnose(tmp_path)
    assert doc["status"] == "stopped" and doc["culprits"] == []
    assert doc["stopped_by"] == {"signal": "SIGINT", "step": 20, "checkpoint": ckpt}
    render(doc, Console(width=300))
    said = capsys.readouterr().out
    assert ": 2 ranks, STOPPED;" in said
    assert f"(stopped by SIGINT at step 20; checkpoint {ckpt} saved; resume with" in said


def test_exception_is_the_culprit_and_the_peer_failure_a_victim(tmp_path: Path) -> None:
    w0, w1 = writers(tmp_path)
    for w in (w0, w1):
        w.log("========== EPOCH 0 TRAINING START ==========")
        w.steps(1, 3)
    w1.fatal("ValueError", "bad value", STEP_FRAMES)
    w0.t = w1.t + 0.5
    w0.fatal("RuntimeError", GLOO, BACKWARD_FRAMES)
    for w in (w0, w1):
        w.flush()
    doc = run_diagnose(tmp_path)
    assert culprits(doc) == [(1, "training step", "exception: ValueError")]
    (culprit,) = doc["culprits"]
    texts = [e["text"] for e in culprit["evidence"]]
    assert "FATAL uncaught exception ValueError" in texts[0]
    assert any("in training_step" in t for t in texts) and texts[-1] == "ValueError: bad value"
    assert culprit["evidence"][0]["file"].startswith("debug_rank1_")
    assert culprit["evidence"][0]["line"] == 9  # 2 header lines, 2 plans, marker, 3 steps, FATAL
    assert [(v["rank"], v["cause"]) for v in doc["victims"]] == [(0, "peer failure: RuntimeError")]
    assert doc["status"] == "failed"


def test_exception_in_a_dataloader_worker_is_data_loading(tmp_path: Path) -> None:
    w0, w1 = writers(tmp_path)
    frames = [("/x/torch/utils/data/_utils/worker.py", "_worker_loop"),
              ("/x/ae/data/shards/tar_samples.py", "read_slices")]  # fmt: skip
    w0.fatal("OSError", "truncated tar", frames, where="dataloader worker 1/2", worker="1/2")
    w0.fatal("OSError", "Caught OSError in DataLoader worker process 1", frames)
    w0.flush()
    w1.flush()
    assert culprits(run_diagnose(tmp_path)) == [(0, "data loading", "exception: OSError")]


def test_fatal_signal(tmp_path: Path) -> None:
    w0, w1 = writers(tmp_path)
    w1.log("========== EPOCH 0 TRAINING START ==========")
    w1.segfault(SEGV_FRAMES)
    w0.fatal("RuntimeError", GLOO, BACKWARD_FRAMES)
    w0.flush()
    w1.flush()
    doc = run_diagnose(tmp_path)
    assert culprits(doc) == [(1, "training step", "fatal signal: SIGSEGV")]
    assert doc["culprits"][0]["evidence"][0]["text"] == "Fatal Python error: Segmentation fault"


def test_error_exit(tmp_path: Path) -> None:
    w0, w1 = writers(tmp_path)
    w1.log("train_shards: shard /d/a-000001.tar vanished", "ERROR")
    w1.exit(2, "DataError")
    w0.epoch(0, 1, 15)
    w0.flush()
    w1.flush()
    doc = run_diagnose(tmp_path)
    assert [(c["rank"], c["cause"]) for c in doc["culprits"]] == [(1, "error exit: DataError")]
    assert "vanished" in doc["culprits"][0]["evidence"][0]["text"]


def test_error_exit_keeps_every_line_of_the_message(tmp_path: Path) -> None:
    """A user error's message can span lines (ConfigError): the evidence holds all of them."""
    w0, w1 = writers(tmp_path)
    w1.log("1 problem in the configuration:", "ERROR")
    w1.raw("  - precision: bf16-mixed needs a GPU with bfloat16")
    w1.exit(2, "ConfigError")
    w0.epoch(0, 1, 15)
    w0.flush()
    w1.flush()
    (culprit,) = run_diagnose(tmp_path)["culprits"]
    texts = [e["text"] for e in culprit["evidence"]]
    assert texts[0].endswith("1 problem in the configuration:")
    assert texts[1] == "  - precision: bf16-mixed needs a GPU with bfloat16"
    assert "Rank exiting with code 2: ConfigError" in texts[2]


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


def test_a_crash_before_the_first_marker_is_in_setup(tmp_path: Path) -> None:
    """The console verdict said `phase ?` for a rank that failed while it set up (a GPU node
    where the rank header could not read ae's version)."""
    (w0,) = writers(tmp_path, world=1)
    w0.fatal("PackageNotFoundError", "No package metadata was found for ae",
             [("/x/ae/rank/train.py", "main"), ("/usr/lib/python3.12/importlib/metadata.py",
               "version")])  # fmt: skip
    w0.flush()
    doc = run_diagnose(tmp_path)
    assert culprits(doc) == [(0, "setup", "exception: PackageNotFoundError")]


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


def test_every_failure_names_a_peer_then_the_first_is_blamed(tmp_path: Path) -> None:
    w0, w1 = writers(tmp_path)
    w1.fatal("DistBackendError", "NCCL error: remote process exited", BACKWARD_FRAMES)
    w0.t = w1.t + 1
    w0.fatal("DistBackendError", "NCCL error: remote process exited", BACKWARD_FRAMES)
    w0.flush()
    w1.flush()
    doc = run_diagnose(tmp_path)
    assert [c[0::2] for c in culprits(doc)] == [(1, "exception: DistBackendError")]
    assert "first rank to fail" in doc["culprits"][0]["rule"]


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


def test_shard_plan_mismatch_and_data_errors(tmp_path: Path) -> None:
    w0, w1 = writers(tmp_path)
    w1.lines = [line.replace("15 batches", "14 batches") for line in w1.lines]
    for i in range(3):
        w0.log(f"Bad sample 0000{i} in shard /d/train-000002.tar: truncated", "ERROR")
    w1.log("Bad shard /d/train-000007.tar: not a tar file", "ERROR")
    w1.log("ERROR-looking text in an INFO line about a shard", "INFO")
    for w in (w0, w1):
        w.exit()
        w.flush()
    doc = run_diagnose(tmp_path)
    assert list(doc["shard_plan_mismatch"]) == ["train"]
    assert "batches=14" in doc["shard_plan_mismatch"]["train"]["1"]
    errors = doc["data_errors"]
    assert errors["lines"] == 4
    assert [(s["shard"], s["lines"], s["ranks"]) for s in errors["shards"]] == [
        ("/d/train-000002.tar", 3, [0]),
        ("/d/train-000007.tar", 1, [1]),
    ]
    assert [r["errors"] for r in doc["ranks"]] == [3, 1]


def test_a_non_finite_loss_is_a_data_error_only_when_its_input_was(tmp_path: Path) -> None:
    """An injected NaN (finite inputs) names the batch's healthy shard: no data error there; a
    sample whose decoded array held a NaN is one."""
    w0, w1 = writers(tmp_path)
    fault = FAULT_INJECTED.format(action="nan", point="train", step=5, rank=1,
                                  effect=": the loss of optimizer step 6 turns NaN")  # fmt: skip
    w1.log(fault, "WARNING")
    w1.log(NONFINITE.format(value="loss=nan", rank=1, step=6, epoch=0, batch="5",
                            samples="shard /d/train-000000.tar, keys [a, b]"), "ERROR")  # fmt: skip
    w0.log(NONFINITE.format(value="loss=nan", rank=0, step=9, epoch=0, batch="8",
                            samples=f"shard /d/train-000003.tar, keys [c] {NONFINITE_INPUT}"),
           "ERROR")  # fmt: skip
    for w in (w0, w1):
        w.exit()
        w.flush()
    errors = run_diagnose(tmp_path)["data_errors"]
    assert errors["lines"] == 1
    assert [(s["shard"], s["ranks"]) for s in errors["shards"]] == [("/d/train-000003.tar", [0])]


def test_rotated_logs_are_read_in_order(tmp_path: Path) -> None:
    (w0, w1) = writers(tmp_path)
    w0.steps(1, 5)
    w0.log("old error", "ERROR")
    w0.flush()
    w0.path.rename(w0.path.with_name(w0.path.name + ".1"))
    w0.steps(6, 7)
    w0.exit()
    w0.flush()
    w1.steps(1, 7)
    w1.exit()
    w1.flush()
    doc = run_diagnose(tmp_path)
    r0 = doc["ranks"][0]
    assert r0["errors"] == 1 and r0["step"] == 7 and r0["state"] == "exited"
    assert r0["logs"] == [f"{w0.path.name}.1", w0.path.name]


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


def test_a_chained_exception_that_started_with_a_peer_failure_is_a_victim(tmp_path: Path) -> None:
    w0, w1 = writers(tmp_path)
    w1.fatal("ValueError", "bad value", STEP_FRAMES)
    w0.t = w1.t + 0.2
    w0.fatal("KeyError", "'state'", BACKWARD_FRAMES)
    during = "During handling of the above exception, another exception occurred:"
    w0.lines[-1:-1] = ["", f"RuntimeError: {GLOO}", "", during]
    w0.flush()
    w1.flush()
    doc = run_diagnose(tmp_path)
    assert [c[0::2] for c in culprits(doc)] == [(1, "exception: ValueError")]
    assert [(v["rank"], v["cause"]) for v in doc["victims"]] == [(0, "peer failure: KeyError")]


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


def test_a_killed_rank_is_first_though_torchrun_names_its_stopped_victim(tmp_path: Path) -> None:
    """Rank 1 stalls and is SIGKILLed; rank 0's all-reduce fails on the closed socket, its
    exception stamped a moment before torchrun noticed rank 1's end (whole seconds): torchrun's
    root cause is rank 0, ended by its own SIGTERM. The killed rank is still the one named."""
    w0, w1 = _rank_1_stalls_rank_0_waits(tmp_path)
    w0.fatal("RuntimeError", GLOO, BACKWARD_FRAMES)
    w0.flush()
    w1.flush()
    _torchrun_report(tmp_path, (0, -15, 4_194_000), (1, -9, 4_194_001))
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


def test_gloos_pair_timeout_through_a_comm_hook_is_a_peer_failure() -> None:
    """A link down, seen through DDP's comm hook (ae's non-finite hook wraps its all-reduce):
    gloo's timeout comes without its file path, and is still the network's, not the rank's."""
    from ae.diagnose.rank_status import is_peer_failure
    from ae.diagnose.tracebacks import Crash

    message = (
        "Got the following error when running the callback: RuntimeError: Application timeout "
        "caused pair closure"
    )
    assert is_peer_failure(Crash([], 0.0, "RuntimeError", "backward", message, "training step"))
    assert not is_peer_failure(Crash([], 0.0, "RuntimeError", "x", "shape mismatch", None))


def test_a_worker_killed_while_handing_over_a_batch_is_the_ranks_own_failure() -> None:
    """Seen in a fresh-clone run: the OOM killer took rank 1's dataloader worker while the rank
    fetched the batch's descriptor from it; the chain starts with that connection's reset, but
    the rank's failure is its worker's death, not a peer's."""
    from ae.diagnose.rank_status import is_peer_failure
    from ae.diagnose.tracebacks import Crash

    killed = "DataLoader worker (pid 10819) is killed by signal: Killed."
    chain = [
        "ConnectionResetError: [Errno 104] Connection reset by peer",
        f"RuntimeError: {killed}",
    ]
    assert not is_peer_failure(
        Crash([], 0.0, "RuntimeError", "x", killed, "data loading", chain=chain)
    )
    stopped = "DataLoader worker (pid 9) is killed by signal: Terminated."  # torchrun's SIGTERM
    chain = [chain[0], f"RuntimeError: {stopped}"]
    assert is_peer_failure(
        Crash([], 0.0, "RuntimeError", "x", stopped, "data loading", chain=chain)
    )
