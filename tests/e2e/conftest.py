"""Launches that several end-to-end tests share: one run, several tests asserting on it, each
named for what it checks. Tests over one shared run are all in the SERIAL xdist_group
(tests/support/runs.py), so that pytest-xdist gives them to one worker, which launches the run
once (a session fixture is per worker)."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

import pytest

from tests.support.runs import RunResult, processes_left, run_launcher
from tests.support.shards import write_test_shards


@dataclass
class FinishedRun:
    result: RunResult
    ended: datetime  # when the launcher had exited
    left: list[list[str]]  # command lines of its processes alive 15 s after that


@pytest.fixture(scope="session")
def rank_1_raises_at_step_3(tmp_path_factory: pytest.TempPathFactory) -> FinishedRun:
    """2 ranks, 15 steps of 8 a rank, one dataloader worker each, --stall_timeout=3; rank 1
    raises InjectedFault in its training step 3 (test_diagnose's verdict, test_forensics' logs)."""
    root = tmp_path_factory.mktemp("rank_1_raises")
    train = write_test_shards(root / "shards", [80, 80, 80], name="train")
    val = write_test_shards(root / "shards", [32], name="val")
    args = [f"--train_shards={train}", f"--val_shards={val}", "--batch_size=8", "--max_epochs=1",
            "--num_workers=1", "--stall_timeout=3"]  # fmt: skip
    out = root / "run"
    res = run_launcher(args, out, env={"AE_FAULT": "raise@train:rank=1:step=3"}, timeout=240)
    ended = datetime.now()
    return FinishedRun(res, ended, processes_left(out))
