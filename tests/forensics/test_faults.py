"""AE_FAULT parsing and when a fault point fires."""

from __future__ import annotations

import subprocess
import sys

import pytest

from ae.forensics import faults as fault_injection
from ae.forensics.faults import Fault, FaultSpecError, InjectedFault, fault_point, parse_faults
from tests.support.runs import ROOT


def test_parse() -> None:
    assert parse_faults("sleep@data:rank=1:step=3:secs=60, raise@train") == [
        Fault("sleep", "data", rank=1, step=3, secs=60.0),
        Fault("raise", "train"),
    ]
    assert parse_faults("sleep@checkpoint:secs=0.5") == [Fault("sleep", "checkpoint", secs=0.5)]


@pytest.mark.parametrize("bad", ["nap@data", "sleep@disk", "sleep@data:when=3", "raise@train:step"])
def test_parse_rejects(bad: str) -> None:
    with pytest.raises(FaultSpecError, match="AE_FAULT"):
        parse_faults(bad)


@pytest.fixture
def faults(monkeypatch: pytest.MonkeyPatch):
    def use(spec: str, rank: int = 0) -> None:
        monkeypatch.setattr(fault_injection, "_faults", parse_faults(spec))
        monkeypatch.setattr(fault_injection, "_fired", set())
        monkeypatch.setenv("RANK", str(rank))

    return use


def test_unset_is_a_no_op() -> None:
    assert fault_injection.active_faults() is None  # the test environment sets no AE_FAULT
    fault_point("train", 0)


def test_train_fires_once_from_its_step_on_its_rank(faults) -> None:
    faults("raise@train:rank=1:step=3", rank=1)
    fault_point("train", 2)
    fault_point("data", 3)  # another point
    with pytest.raises(InjectedFault):
        fault_point("train", 4)  # the first call at or after step 3 (a skipped step 3 counts)
    fault_point("train", 5)  # once per process


def test_other_rank_and_data_exact_step(faults) -> None:
    faults("raise@train:rank=1,raise@data:step=3", rank=0)
    fault_point("train", 9)
    fault_point("data", 4)  # data: exactly the batch (one process produces it)
    with pytest.raises(InjectedFault):
        fault_point("data", 3)


def test_sleep_logs_first(faults, monkeypatch: pytest.MonkeyPatch) -> None:
    slept: list[float] = []
    monkeypatch.setitem(fault_injection._ACT, "sleep", slept.append)
    messages: list[str] = []
    from loguru import logger

    sink = logger.add(lambda m: messages.append(m.record["message"]))
    try:
        faults("sleep@checkpoint:secs=2.5", rank=0)
        fault_point("checkpoint", 10)
    finally:
        logger.remove(sink)
    assert slept == [2.5]
    assert messages == ["FAULT injected: sleep@checkpoint at step 10 (rank 0)"]


def test_slow_parses_and_needs_ms() -> None:
    assert parse_faults("slow@data:rank=1:ms=50,slow@train:ms=2.5:step=3:until=9") == [
        Fault("slow", "data", rank=1, ms=50.0),
        Fault("slow", "train", step=3, ms=2.5, until=9),
    ]
    for bad in ("slow@data", "slow@train:ms=0", "slow@train:ms=x"):
        with pytest.raises(FaultSpecError, match="AE_FAULT"):
            parse_faults(bad)


def test_slow_acts_at_every_call_in_its_steps_and_logs_once(
    faults, monkeypatch: pytest.MonkeyPatch
) -> None:
    slept: list[float] = []
    monkeypatch.setattr(fault_injection, "_injected_slow", slept.append)
    messages: list[str] = []
    from loguru import logger

    sink = logger.add(lambda m: messages.append(m.record["message"]))
    try:
        faults("slow@data:rank=1:ms=50:step=2:until=5", rank=1)
        for step in range(8):
            fault_point("data", step)
        faults("slow@data:rank=1:ms=50", rank=0)
        fault_point("data", 3)  # another rank
    finally:
        logger.remove(sink)
    assert slept == [0.05, 0.05, 0.05]  # steps 2, 3, 4
    assert messages == ["FAULT injected: slow@data at step 2 (rank 1)"]


def test_grow_needs_mb_and_holds_resident_memory() -> None:
    assert parse_faults("grow@data:rank=1:mb=64") == [Fault("grow", "data", rank=1, mb=64.0)]
    with pytest.raises(FaultSpecError, match="grow needs mb=M"):
        parse_faults("grow@data")
    # In a fresh process: a long-lived one (a pytest worker) may hold freed heap pages that the
    # allocation reuses, already resident, so its RSS would not move.
    grown = subprocess.run(
        [sys.executable, "-c", GROW_64_MB], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert grown.returncode == 0, grown.stderr
    assert float(grown.stdout) > 60  # touched: resident, not only reserved


GROW_64_MB = """
from ae.forensics import faults
from ae.forensics.process_stats import process_rss_mb
before = process_rss_mb()
faults._injected_grow(64)
print(process_rss_mb() - before)
"""


def test_desync_parses_with_a_size_and_needs_a_positive_one() -> None:
    assert parse_faults("desync@train:rank=1:step=3") == [Fault("desync", "train", rank=1, step=3)]
    assert parse_faults("desync@train:size=3224")[0].size == 3224
    with pytest.raises(FaultSpecError, match="desync needs size"):
        parse_faults("desync@train:size=0")


def test_attempt_picks_the_attempt_of_a_restarting_job(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AE_FAULT", "kill@train:step=5:attempt=0,raise@train:step=2")
    for attempt, actions in (("0", ["kill", "raise"]), ("1", ["raise"])):
        monkeypatch.setenv(fault_injection.ATTEMPT_ENV, attempt)
        monkeypatch.setattr(fault_injection, "_faults", fault_injection._UNREAD)
        assert [f.action for f in fault_injection.active_faults() or []] == actions
    monkeypatch.setenv("AE_FAULT", "kill@train:attempt=0")
    monkeypatch.setattr(fault_injection, "_faults", fault_injection._UNREAD)
    assert fault_injection.active_faults() is None  # none of them in attempt 1: a no-op


def test_gpusleep_parses_and_without_cuda_sleeps_on_the_host(
    faults, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert parse_faults("gpusleep@train:rank=0:step=5:secs=60") == [
        Fault("gpusleep", "train", rank=0, step=5, secs=60.0)
    ]
    # On a CPU build the hung kernel becomes a host sleep of the same length (the GPU path is
    # exercised by bench/gpu_proof.py on a lent GPU).
    slept: list[float] = []
    monkeypatch.setattr(fault_injection.time, "sleep", slept.append)
    faults("gpusleep@train:step=2:secs=0.25", rank=0)
    fault_point("train", 2)
    assert slept == [0.25]
