"""One rank's flow (`ae.rank.train`): the parts that run without a process group."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ae.config import parse_config
from ae.errors import ResourceLimitError
from ae.job.preflight import MB, Need
from ae.rank import train
from logging_cfg.rank_context import RankContext


def test_tight_limits_are_said_by_local_rank_0_and_in_every_ranks_refusal(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, records: list[tuple[str, str]]
) -> None:
    """The ranks' preflight is the one that says a tight limit (the launcher's only stops): by
    local rank 0 alone as a warning; beside a refusal, in every rank's refusal (the first rank to
    refuse ends the others, local rank 0 among them, before they speak)."""
    tight = Need("open files (ulimit -n)", 180, 156, "how", "ulimit -n 65536", count=True)
    short = Need("shared memory /dev/shm", 4 * MB, 80 * MB, "how", "fix")
    cfg = parse_config([f"--output_dir={tmp_path}"])
    model = torch.nn.Linear(2, 2)
    said = f"Resource tight: {tight.describe()}"
    monkeypatch.setattr(train, "rank_needs", lambda *a, **k: [tight])
    for ctx, warnings in [(RankContext(rank=0, world_size=2), [said]),
                          (RankContext(rank=1, world_size=2, local_rank=1), [])]:  # fmt: skip
        records.clear()
        train.preflight(cfg, ctx, batch_bytes=MB, model=model)
        assert [m for level, m in records if level == "WARNING"] == warnings

    monkeypatch.setattr(train, "rank_needs", lambda *a, **k: [tight, short])
    records.clear()
    other = RankContext(rank=1, world_size=2, local_rank=1)
    with pytest.raises(ResourceLimitError) as e:
        train.preflight(cfg, other, batch_bytes=MB, model=model)
    assert e.value.problems == [short.describe()]
    assert e.value.render().splitlines()[1:] == [f"  - {short.describe()}", f"  - {said}"]
    assert [m for level, m in records if level == "WARNING"] == []
