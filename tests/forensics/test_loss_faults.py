"""AE_FAULT's loss faults (`nan@train`, `inf@train`): the loss of one rank turns non-finite at
one step, once; `fault_point` leaves them alone."""

from __future__ import annotations

import math

import pytest

from ae.forensics import faults as fault_injection
from ae.forensics.faults import Fault, FaultSpecError, fault_point, loss_poison, parse_faults


def use(monkeypatch: pytest.MonkeyPatch, spec: str, rank: int) -> None:
    monkeypatch.setattr(fault_injection, "_faults", parse_faults(spec))
    monkeypatch.setattr(fault_injection, "_fired", set())
    monkeypatch.setenv("RANK", str(rank))


def test_parse_loss_faults() -> None:
    assert parse_faults("nan@train:rank=1:step=20") == [Fault("nan", "train", rank=1, step=20)]
    with pytest.raises(FaultSpecError, match="acts on the loss"):
        parse_faults("nan@data:step=3")


def test_nan_on_the_named_rank_at_its_step_once(monkeypatch: pytest.MonkeyPatch) -> None:
    use(monkeypatch, "nan@train:rank=1:step=5", rank=0)
    assert [loss_poison(s) for s in (5, 6)] == [None, None]  # another rank
    use(monkeypatch, "nan@train:rank=1:step=5", rank=1)
    fault_point("train", 5)  # no action of its own at the fault point
    values = [loss_poison(s) for s in (4, 5, 6)]
    assert values[0] is None and math.isnan(values[1]) and values[2] is None


def test_inf(monkeypatch: pytest.MonkeyPatch) -> None:
    use(monkeypatch, "inf@train", rank=0)
    assert loss_poison(0) == math.inf
