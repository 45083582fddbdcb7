"""One rank's flow (`ae.rank.train`): the parts that run without a process group."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from ae.config import parse_config
from ae.errors import ResourceLimitError
from ae.job.preflight import MB, Need
from ae.log_lines import TRAINING_FINISHED
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


@pytest.mark.parametrize(
    ("flags", "step", "epoch", "said"),
    [(["--max_steps=20", "--max_epochs=3"], 15, 3, " (--max_epochs=3 reached)"),
     (["--max_steps=20", "--max_epochs=3"], 20, 2, " (--max_steps=20 reached)"),
     (["--max_steps=20", "--max_epochs=3"], 7, 1, "")],  # a LightningModule's should_stop
)  # fmt: skip
def test_the_finished_line_says_which_limit_ended_the_run(
    tmp_path: Path, flags: list[str], step: int, epoch: int, said: str
) -> None:
    """A `--max_steps=20` run that ends at step 15 ended on --max_epochs: the line says so, and
    ae-diagnose reads its step from it as from the lines of older versions."""
    cfg = parse_config([f"--output_dir={tmp_path}", *flags])
    trainer = SimpleNamespace(global_step=step, current_epoch=epoch)
    line = TRAINING_FINISHED.format(step=step, limit=train.reached(trainer, cfg))
    assert line == f"Training finished at step {step}{said}"
    assert TRAINING_FINISHED.parse(line)["step"] == str(step)
    assert TRAINING_FINISHED.parse("Training finished at step 23")["step"] == "23"
