"""What a resumed launch says about itself in its train log: the checkpoint and step it resumed
from, the step it finished at, and no lost EMA state."""

from __future__ import annotations

import re

from tests.support.runs import RunResult


def assert_resumed(res: RunResult, at: int, to: int) -> None:
    (log,) = [p for p in res.log("train_*.log") if "Resumed" in p.read_text()]
    text = log.read_text()
    assert re.search(rf"Resumed from \S+last\.ckpt at step {at} ", text), text
    assert f"Training finished at step {to}" in text
    assert "not created with WeightAveraging" not in text  # the EMA state came back too
