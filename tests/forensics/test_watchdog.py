"""The watchdog thread, stall reports and heartbeat files, in-process with a private Progress."""

from __future__ import annotations

import json
import signal
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from loguru import logger

from ae.forensics import stall_report
from ae.forensics.faults import _injected_sleep
from ae.forensics.heartbeat import heartbeat_record, write_heartbeat
from ae.forensics.process_stats import RssReader
from ae.forensics.progress import STUCK_AFTER_S, Progress
from ae.forensics.stall_report import collective_wait, describe_frame, thread_stacks
from ae.forensics.watchdog import Watchdog
from ae.log_lines import HEARTBEAT_FIELDS, STALL, STALL_ENDED, STALL_RESOLVED, STOP_SIGNAL
from logging_cfg import RankContext


@pytest.fixture
def records() -> Iterator[list[str]]:
    out: list[str] = []
    sink = logger.add(lambda m: out.append(str(m.record["message"])), level="DEBUG")
    yield out
    logger.remove(sink)


def _wait_for(predicate, timeout: float = 10.0) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if predicate():
            return True
        time.sleep(0.05)
    return False


def test_stall_report_backoff_and_resolved(tmp_path: Path, records: list[str]) -> None:
    prog = Progress()
    prog.enter("data loading", step=7, epoch=1)
    heartbeat = tmp_path / "heartbeat_rank0_TS.json"
    dog = Watchdog(0.4, RankContext(), heartbeat, progress=prog)
    dog.start()
    try:
        _injected_sleep(2.0)  # the main thread "hangs" here: idle crosses 0.4, 0.8 and 1.6 s
        stalls = [STALL.parse(r) for r in records if r.startswith("STALL detected")]
        assert len(stalls) >= 2, records
        for i, s in enumerate(stalls):  # back-off: report k comes at >= 0.4 * 2**(k-1) idle
            assert s is not None and s["phase"] == "data loading"
            assert (s["epoch"], s["step"], s["report"]) == ("1", "7", str(i + 1))
            assert float(s["idle"]) >= 0.4 * 2**i
            assert s["frame"].startswith("_injected_sleep (ae/forensics/faults.py:")
            assert s["collective"] == "no"
        report = next(r for r in records if r.startswith("STALL report 1:"))
        assert "Thread MainThread" in report and "in _injected_sleep" in report
        assert "ae-watchdog" not in report  # the reporting thread leaves itself out
        assert "rank    pid=" in report and "status=" in report and "fds=" in report
        assert json.loads(heartbeat.read_text())["stalled"] is True

        prog.beat(step=8)
        assert _wait_for(lambda: any(r.startswith("STALL RESOLVED") for r in records))
        resolved = STALL_RESOLVED.parse(next(r for r in records if "RESOLVED" in r))
        assert resolved is not None and resolved["phase"] == "data loading"
        assert float(resolved["idle"]) >= 2.0 and resolved["now"] == "phase data loading, step 8"
    finally:
        dog.stop()
    final = json.loads(heartbeat.read_text())
    assert tuple(final) == HEARTBEAT_FIELDS
    assert final["state"] == "exited" and final["stalled"] is False and final["step"] == 8


def test_heartbeat_is_stalled_before_the_stall_line(tmp_path: Path) -> None:
    """Whoever reads a STALL line (ae-diagnose, then --watch) finds `stalled` in the heartbeat."""
    heartbeat = tmp_path / "heartbeat_rank0_TS.json"
    seen: list[bool] = []

    def sink(m) -> None:
        if str(m.record["message"]).startswith("STALL detected"):
            seen.append(json.loads(heartbeat.read_text())["stalled"])

    sink_id = logger.add(sink, level="WARNING")
    prog = Progress()
    prog.enter("training step", step=3, epoch=0)
    dog = Watchdog(0.3, RankContext(), heartbeat, progress=prog)
    dog.start()
    try:
        assert _wait_for(lambda: bool(seen))
    finally:
        dog.stop()
        logger.remove(sink_id)
    assert seen[0] is True


def test_no_report_while_beating(records: list[str]) -> None:
    prog = Progress()
    dog = Watchdog(0.4, RankContext(), progress=prog)
    dog.start()
    try:
        for step in range(30):
            prog.beat(step=step)
            time.sleep(0.05)
    finally:
        dog.stop()
    assert not [r for r in records if "STALL" in r]


def test_stop_signal_is_logged_once_by_the_watchdog(records: list[str]) -> None:
    """The signal handler only stores the signal and where the rank was; the watchdog thread
    writes the line with that phase and step, even when the rank has moved on since."""
    prog = Progress()
    prog.enter("training step", step=12)
    dog = Watchdog(60, RankContext(), progress=prog)
    dog.check()
    prog.record_stop_signal("SIGTERM")
    prog.enter("teardown", step=13)
    dog.check()
    dog.check()
    assert prog.stop_line() is None  # said once: the step boundary finds nothing left to say
    lines = [r for r in records if STOP_SIGNAL.prefix in r]
    assert lines == [STOP_SIGNAL.format(signal="SIGTERM", phase="training step", step=12)]


def test_a_stop_signal_in_teardown_stays_off_the_console() -> None:
    """A rank already leaving (its peer's user error: torchrun SIGTERMs it) wrote `Stop signal
    SIGTERM received in phase teardown` as a WARNING: on rank 0's console, after the failure's
    message and its way on. INFO keeps it in the debug log only; a stop in training stays a
    WARNING."""
    levels: list[tuple[str, str]] = []
    sink = logger.add(lambda m: levels.append((m.record["level"].name, m.record["message"])))
    try:
        for phase in ("teardown", "training step"):
            prog = Progress()
            prog.enter(phase, step=5)
            prog.record_stop_signal("SIGTERM")
            Watchdog(60, RankContext(), progress=prog).check()
    finally:
        logger.remove(sink)
    stops = [(level, msg.split(" in phase ")[1]) for level, msg in levels
             if msg.startswith(STOP_SIGNAL.prefix)]  # fmt: skip
    assert stops == [("INFO", "teardown at step 5"), ("WARNING", "training step at step 5")]


def test_a_stall_left_for_teardown_is_not_resolved(records: list[str]) -> None:
    """A rank waiting in a collective whose peer died leaves the stall for teardown: no STALL
    RESOLVED (rank 0's console would print it), one INFO line saying what happened."""
    prog = Progress()
    prog.enter("training step", step=5)
    dog = Watchdog(0.2, RankContext(), progress=prog)
    prog.last_beat -= 1.0
    dog.check()
    assert any(r.startswith("STALL detected") for r in records)
    prog.record_stop_signal("SIGTERM")
    prog.enter("teardown")
    dog.check()
    assert not [r for r in records if r.startswith("STALL RESOLVED")]
    (ended,) = [r for r in records if r.startswith("STALL ended")]
    m = STALL_ENDED.parse(ended)
    assert m is not None and m["phase"] == "training step" and m["why"] == "stop signal SIGTERM"


def _frame_in(path: str, name: str):
    """A live frame of a function called `name` whose code says it lives in `path`."""
    code = f"def {name}(box):\n    box.append(sys._getframe())\n"
    namespace: dict = {"sys": sys}
    exec(compile(code, path, "exec"), namespace)
    box: list = []
    namespace[name](box)
    return box[0]


def test_collective_wait_guess() -> None:
    barrier = _frame_in("/x/site-packages/torch/distributed/distributed_c10d.py", "barrier")
    assert collective_wait(barrier) == "yes (barrier)"
    assert describe_frame(barrier) == "barrier (torch/distributed/distributed_c10d.py:2)"
    sigterm = _frame_in("/x/site-packages/lightning/loop.py", "_broadcast_sigterm_tensor")
    assert collective_wait(sigterm) == "yes (_broadcast_sigterm_tensor)"
    # A queue wait (data loading) is not a collective, even if it is called `wait`.
    assert collective_wait(_frame_in("/usr/lib/python3.11/threading.py", "wait")) == "no"
    # Without an initialized process group, backward is just backward.
    backward = _frame_in("/x/site-packages/torch/autograd/graph.py", "_engine_run_backward")
    assert collective_wait(backward) == "no"


def _chain(*calls: tuple[str, str]):
    """The innermost live frame of nested calls, outermost first: (file, function) each."""
    namespace: dict = {"sys": sys}
    for path, name in calls:
        body = "inner[0](box, inner[1:]) if inner else box.append(sys._getframe())"
        code = f"def {name}(box, inner):\n    {body}\n"
        exec(compile(code, path, "exec"), namespace)
        namespace[f"fn_{name}"] = namespace[name]
    box: list = []
    fns = [namespace[f"fn_{name}"] for _, name in calls]
    fns[0](box, fns[1:])
    return box[0]


def test_a_collective_that_a_comm_hook_calls_in_backward_is_ddps(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """ae's comm hook all-reduces on the training thread (gloo): the innermost frame is
    torch's all_reduce, backward a few frames out. Called outside backward, it stays itself."""
    monkeypatch.setattr(stall_report, "_ddp_active", lambda: True)
    hook = _chain(
        ("/x/site-packages/torch/autograd/graph.py", "_engine_run_backward"),
        ("/x/ae/training/nonfinite.py", "_reduce"),
        ("/x/site-packages/torch/distributed/c10d_logger.py", "wrapper"),
        ("/x/site-packages/torch/distributed/distributed_c10d.py", "all_reduce"),
    )
    assert collective_wait(hook) == "yes (DDP gradient all-reduce in backward)"
    user = _chain(
        ("/x/site-packages/lightning/loop.py", "training_step"),
        ("/x/model.py", "forward"),
        ("/x/site-packages/torch/distributed/distributed_c10d.py", "all_reduce"),
    )
    assert collective_wait(user) == "yes (all_reduce)"
    # The all-reduce failed (its peer left), and c10d's wrapper logs it when the stop signal
    # comes: still the collective, not `code: _get_msg_dict` (seen on a Ctrl-C'd hang)
    failed = _chain(
        ("/x/site-packages/torch/autograd/graph.py", "_engine_run_backward"),
        ("/x/ae/training/nonfinite.py", "_reduce"),
        ("/x/ae/training/nonfinite.py", "register_hook"),
        ("/x/site-packages/torch/distributed/c10d_logger.py", "wrapper"),
        ("/x/site-packages/torch/distributed/c10d_logger.py", "_get_msg_dict"),
    )
    assert collective_wait(failed) == "yes (DDP gradient all-reduce in backward)"


def test_thread_stacks_name_every_thread() -> None:
    stop = threading.Event()
    t = threading.Thread(target=stop.wait, name="sleepy-helper", daemon=True)
    t.start()
    try:
        text = thread_stacks()
    finally:
        stop.set()
        t.join()
    assert text.startswith("Thread MainThread")
    assert "Thread sleepy-helper" in text and "in test_thread_stacks_name_every_thread" in text


def test_heartbeat_rewrite_is_atomic(tmp_path: Path) -> None:
    """A reader polling the file while it is rewritten always reads one whole JSON object."""
    path = tmp_path / "heartbeat_rank0_TS.json"
    prog, rss = Progress(), RssReader()
    write_heartbeat(path, heartbeat_record(RankContext(), prog, rss, stalled=False))
    done = threading.Event()
    seen: list[int] = []

    def writer() -> None:
        for step in range(300):
            prog.beat(step=step)
            write_heartbeat(path, heartbeat_record(RankContext(), prog, rss, stalled=False))
        done.set()

    t = threading.Thread(target=writer)
    t.start()
    while not done.is_set():
        record = json.loads(path.read_text())  # raises on a torn or empty file
        assert tuple(record) == HEARTBEAT_FIELDS
        seen.append(record["step"])
    t.join()
    assert json.loads(path.read_text())["step"] == 299
    assert seen == sorted(seen)  # never an older content after a newer one
    assert [p.name for p in tmp_path.iterdir()] == [path.name]  # no temporary file left


def test_a_stop_signal_is_delivered_again_to_a_rank_that_stays_stuck() -> None:
    """SIGTERM came while the rank was busy (the handler let it run on to the next step, where
    the ranks save together); STUCK_AFTER_S later it has made no progress: the watchdog delivers
    the signal again, once, for the handler to leave. Not in a phase that may take long."""
    got: list[int] = []
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: got.append(signum))
    try:
        for phase, expected in [("data loading", [signal.SIGTERM]), ("checkpoint save", [])]:
            got.clear()
            prog = Progress()
            prog.enter(phase, step=7)
            dog = Watchdog(60, RankContext(), progress=prog)
            prog.record_stop_signal("SIGTERM")
            dog.check()
            assert got == []  # just signalled: the rank may still reach its step
            prog.last_beat -= STUCK_AFTER_S + 1
            dog.check()
            dog.check()
            assert got == expected, phase
    finally:
        signal.signal(signal.SIGTERM, previous)
