"""The stop-signal handler (SIGTERM, SIGINT): records the signal, leaves a stuck rank, and never
logs."""

from __future__ import annotations

import signal
import time
from collections.abc import Iterator

import pytest
from loguru import logger

from ae.forensics.progress import progress
from ae.training import preemption
from ae.training.preemption import SigtermWhileStuck


@pytest.fixture
def fresh_progress(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    for name in ("stop_signal", "stop_signal_at", "stop_phase", "stop_step", "_stop_said",
                 "last_beat", "phase", "step"):  # fmt: skip
        monkeypatch.setattr(progress, name, getattr(progress, name))
    progress.stop_signal = progress.stop_signal_at = None
    yield


def _signal_during_a_log_write(idle_s: float, signum: int = signal.SIGTERM) -> list[BaseException]:
    """Deliver a stop signal (call the handler) while the main thread is inside a loguru sink."""
    progress.enter("data loading", step=7)
    progress.last_beat = time.monotonic() - idle_s
    raised: list[BaseException] = []

    def sink(message: object) -> None:
        try:
            preemption.on_stop_signal(signum, None)
        except BaseException as e:
            raised.append(e)

    handle = logger.add(sink, format="{message}")
    try:
        logger.info("a line being written when the signal comes")
    finally:
        logger.remove(handle)
    return raised


def test_handler_in_a_busy_rank_only_records(fresh_progress: None) -> None:
    assert _signal_during_a_log_write(idle_s=0.0) == []
    assert progress.stop_signal == "SIGTERM" and progress.stop_signal_at is not None
    assert (progress.stop_phase, progress.stop_step) == ("data loading", 7)  # where it came
    assert preemption.stop_signal_received()


def test_stuck_rank_leaves_without_logging_in_the_handler(
    fresh_progress: None, capfd: pytest.CaptureFixture[str]
) -> None:
    """Logging from the handler would re-enter the sink being written (loguru drops the line
    with a "Logging error ... not re-entrant" on stderr); the rank must leave with
    SigtermWhileStuck, which its entry point logs."""
    raised = _signal_during_a_log_write(idle_s=60.0)
    assert "Logging error" not in capfd.readouterr().err
    assert [type(e) for e in raised] == [SigtermWhileStuck]
    stuck = raised[0]
    assert isinstance(stuck, SigtermWhileStuck) and stuck.code == 143
    assert stuck.describe().startswith("Stop signal SIGTERM after 60s without progress in phase")
    assert "data loading (step 7)" in stuck.describe()


def test_ctrl_c_takes_the_same_path(fresh_progress: None) -> None:
    """SIGINT (Ctrl-C) is recorded as such, and does not raise KeyboardInterrupt in a busy rank;
    a stuck rank leaves with 130 (128 + SIGINT)."""
    assert _signal_during_a_log_write(idle_s=0.0, signum=signal.SIGINT) == []
    assert progress.stop_signal == "SIGINT"
    progress.stop_signal = None
    (stuck,) = _signal_during_a_log_write(idle_s=60.0, signum=signal.SIGINT)
    assert isinstance(stuck, SigtermWhileStuck) and stuck.code == 130
    assert stuck.describe().startswith("Stop signal SIGINT after 60s")
