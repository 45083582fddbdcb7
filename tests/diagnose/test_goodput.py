"""What a job's failures cost (`ae-diagnose --goodput`), over synthetic logs of two attempts in
the real line formats, with every time placed by hand: each part is the one the definition in
ae/diagnose/goodput.py gives, and the parts add up to the wall time."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ae.diagnose.attempts import diagnose_job
from ae.diagnose.cli import main
from ae.diagnose.goodput import PARTS, goodput_line, job_goodput
from ae.diagnose.log_files import find_run
from ae.log_lines import (
    CHANGE_OF_NODES,
    CHECKPOINT_END,
    CHECKPOINT_START,
    FAULT_INJECTED,
    GOODPUT,
    RESTART,
    TRAIN_STEP,
    TRAINING_FINISHED,
    epoch_marker,
)
from bench.synthetic_logs import T0, RankWriter, record, write_heartbeat, write_train_log

TS1, TS2 = "20261121_120000", "20261121_120100"
STEP = ", lr=0.001, 300 samples/s, rss=400MB workers=1x300MB"


def at(w: RankWriter, t: float, message: str, level: str = "INFO") -> None:
    """A record of `w` at T0 + t seconds."""
    w.t = T0 + t
    w.log(message, level, dt=0)


def steps(w: RankWriter, times: dict[int, float]) -> None:
    for step, t in times.items():
        at(w, t, TRAIN_STEP.format(step=step, loss="0.25", detail=STEP), "DEBUG")


def run_time(data_s: float) -> dict:
    return {"recent": None, "epoch": None, "run": {"steps": 6, "data_s": data_s}}


def restart_line(previous: str, resume: int, failed: str) -> str:
    return RESTART.format(attempt=1, max=2, failed=failed, step=6, resume=resume,
                          checkpoint="ckpt/step-00000004.ckpt", redone=6 - resume,
                          previous=previous, nodes="")  # fmt: skip


def two_attempts(logs: Path, failed: str = "rank 1 on node1, phase training step: killed") -> None:
    """Attempt 0: first step at 2 s, a save of step 4 from 6 to 6.5 s, rank 1 killed after its
    step 6 at 8.5 s, rank 0's last record at 11 s. Attempt 1 (resumed from step 4): its first
    record at 20 s, first step at 22 s, validation 30-31 s, `Training finished` at 31.5 s, its
    last record at 32 s."""
    write_train_log(logs, 2, ts=TS1)
    w0, w1 = RankWriter(logs, 0, 2, ts=TS1), RankWriter(logs, 1, 2, ts=TS1)
    for w in (w0, w1):
        w.start(host=f"node{w.rank}")
        at(w, 2.0, epoch_marker(0, "TRAINING", "START"))
        steps(w, {1: 3.0, 2: 4.0, 3: 5.0, 4: 6.0})
    path = "ckpt/step-00000004.ckpt"
    at(w0, 6.0, CHECKPOINT_START.format(step=4, reason="periodic", path=path))
    at(w0, 6.5, CHECKPOINT_END.format(step=4, reason="periodic", path=path, size="1 KB",
                                      seconds="0.5"))  # fmt: skip
    for w in (w0, w1):
        steps(w, {5: 7.5, 6: 8.5})
    fault = FAULT_INJECTED.format(action="kill", point="train", step=6, rank=1, effect="")
    at(w1, 8.5, fault, "WARNING")
    at(w0, 10.0, "FATAL uncaught exception RuntimeError in main thread: gloo: peer", "CRITICAL")
    at(w0, 11.0, "Rank exiting with code 1: failed")
    for w in (w0, w1):
        w.flush()
    write_heartbeat(logs, 0, 2, pid=1, t=T0 + 11.0, phase="teardown", step=6, state="failed",
                    last_progress=T0 + 10.5, ts=TS1, timing=run_time(1.0))  # fmt: skip
    write_heartbeat(
        logs,
        1,
        2,
        pid=2,
        t=T0 + 7.0,
        phase="training step",
        step=5,
        last_progress=T0 + 7.0,
        ts=TS1,
        timing=run_time(0.5),
    )  # stale: killed
    # attempt 1: the RESTART line first, then one rank alone
    train = write_train_log(logs, 1, ts=TS2)
    head = record(T0 + 20.0, "WARNING", 0, 1, restart_line(TS1, 4, failed))
    train.write_text(head + "\n" + train.read_text().replace(
        record(T0, "INFO", 0, 1, "Setup: distributed, world size 1"),
        record(T0 + 20.1, "INFO", 0, 1, "Setup: distributed, world size 1")).replace(
        record(T0, "INFO", 0, 1, "Resolved config:"),
        record(T0 + 20.1, "INFO", 0, 1, "Resolved config:")))  # fmt: skip
    r0 = RankWriter(logs, 0, 1, ts=TS2, t=T0 + 20.5)
    r0.start()
    at(r0, 22.0, epoch_marker(0, "TRAINING", "START"))
    steps(r0, {5: 23.0, 12: 29.0})
    at(r0, 29.5, epoch_marker(0, "TRAINING", "END"))
    at(r0, 30.0, epoch_marker(0, "VALIDATION", "START"))
    at(r0, 31.0, epoch_marker(0, "VALIDATION", "END"))
    at(r0, 31.5, TRAINING_FINISHED.format(step=12, limit=""))
    at(r0, 32.0, "Rank exiting with code 0: training finished")
    r0.flush()
    write_heartbeat(logs, 0, 1, pid=3, t=T0 + 32.0, phase="teardown", step=12, state="exited",
                    last_progress=T0 + 31.9, ts=TS2, timing=run_time(2.0))  # fmt: skip


def test_a_restarted_job_splits_its_wall_time_into_parts_that_add_up(tmp_path: Path) -> None:
    logs = tmp_path / "logs"
    two_attempts(logs)
    found = job_goodput(find_run(logs, TS2), last_failed=False)
    assert found is not None and found["attempts"] == 2 and found["runs"] == [TS1, TS2]
    parts = found["parts"]
    assert found["wall_s"] == pytest.approx(32.0)
    assert parts["startup"] == pytest.approx(2.0)  # first record to the first step
    assert parts["checkpoint"] == pytest.approx(0.5)
    assert parts["validation"] == pytest.approx(1.0)
    # the failure: rank 1's progress line at 8.5 s (its heartbeat is older; rank 0 tore down)
    assert parts["detection"] == pytest.approx(11.0 - 8.5)
    assert parts["recompute"] == pytest.approx(8.5 - 6.5)  # after the step-4 save: redone
    assert parts["restart"] == pytest.approx(22.0 - 11.0)  # attempt 0's end to the next step
    # attempt 0 trained 6 s (8.5 - 2 - 0.5), 2 of them redone; 1 s of data wait over 6 s, of
    # which the 4 s kept hold 2/3; attempt 1: 8.5 s, 2 s of them waiting for data
    assert parts["data_wait"] == pytest.approx(1.0 * 4 / 6 + 2.0, abs=1e-3)
    assert parts["training"] == pytest.approx(4.0 - 4 / 6 + 6.5, abs=1e-3)
    assert parts["other"] == pytest.approx(0.5)  # after `Training finished`
    assert sum(parts.values()) == pytest.approx(found["wall_s"], abs=0.01)
    assert list(parts) == list(PARTS)
    assert found["effective_share"] == pytest.approx(parts["training"] / 32.0, abs=1e-3)
    line = GOODPUT.parse(goodput_line(found))
    assert line is not None and line["attempts"] == "2" and line["wall"] == "32.0"
    assert line["parts"].startswith("restart 11.0s, detection 2.5s, recompute 2.0s, ")


def test_a_restart_to_take_in_a_node_redoes_nothing(tmp_path: Path) -> None:
    logs = tmp_path / "logs"
    two_attempts(logs, failed=CHANGE_OF_NODES)
    parts = job_goodput(find_run(logs, TS1), last_failed=False)["parts"]  # any attempt names it
    assert parts["recompute"] == 0.0 and parts["detection"] == 0.0
    assert parts["other"] == pytest.approx(11.0 - 8.5 + 0.5)  # a stop's end, then the tail
    assert sum(parts.values()) == pytest.approx(32.0, abs=0.01)


def test_goodput_is_in_the_json_and_has_a_view_of_its_own(tmp_path: Path, capsys) -> None:
    logs = tmp_path / "logs"
    two_attempts(logs)
    doc = diagnose_job(find_run(logs, TS2))
    assert doc["goodput"]["wall_s"] == pytest.approx(32.0)
    assert main([str(logs), "--goodput"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("Goodput ") and "  restart           11.0s" in out, out
    assert main([str(logs), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["goodput"] == doc["goodput"]


def test_a_hang_stopped_by_ctrl_c_is_not_training_time(tmp_path: Path) -> None:
    """README's hang (`AE_FAULT=sleep@data:rank=1`), then Ctrl-C 30 s later: both ranks beat in
    `teardown` on their way out and neither wrote an ERROR. The stall after the last step (3 s
    to 35 s) is the stop's `other`, not training (was: 97% goodput, every second `training`)."""
    logs = tmp_path / "logs"
    write_train_log(logs, 2, ts=TS1)
    for rank in (0, 1):
        w = RankWriter(logs, rank, 2, ts=TS1)
        w.start()
        at(w, 1.0, epoch_marker(0, "TRAINING", "START"))
        steps(w, {1: 2.0, 2: 2.5, 3: 3.0})
        at(w, 8.0, "STALL detected: no progress for 5.0s", "WARNING")
        at(w, 35.0, "Stop signal SIGINT after 32s without progress", "WARNING")
        w.flush()
        write_heartbeat(logs, rank, 2, pid=1 + rank, t=T0 + 35.0, phase="teardown", step=3,
                        state="failed", last_progress=T0 + 35.0, ts=TS1,
                        timing=run_time(0.1))  # fmt: skip
    found = job_goodput(find_run(logs, TS1), last_failed=False)
    assert found is not None
    parts = found["parts"]
    assert parts["training"] + parts["data_wait"] == pytest.approx(3.0 - 1.0)
    assert parts["other"] == pytest.approx(35.0 - 3.0)
    assert sum(parts.values()) == pytest.approx(found["wall_s"], abs=0.01)
