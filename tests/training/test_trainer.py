"""The trainer refuses a precision its device cannot do, rather than running another."""

from __future__ import annotations

import pytest

from ae.config import ConfigError, RunConfig, parse_config
from ae.training.trainer import build_trainer, check_precision
from logging_cfg import RankContext


def test_16_mixed_on_a_cpu_is_refused_not_replaced_by_bf16() -> None:
    with pytest.raises(ConfigError, match=r"precision: 16-mixed needs a GPU.*--precision=32"):
        check_precision(RunConfig(precision="16-mixed"), "cpu")
    check_precision(RunConfig(precision="bf16-mixed"), "cpu")  # what Lightning runs on a CPU


def test_val_shards_none_builds_a_trainer_that_never_validates(tmp_path) -> None:
    """Validation off: Lightning's own switch at 0, so no val loss and no best.ckpt."""
    base = [f"--output_dir={tmp_path}", "--accelerator=cpu"]
    off = build_trainer(parse_config([*base, "--val_shards=none"]), RankContext(), "TS", {})
    assert off.limit_val_batches == 0
    assert build_trainer(parse_config(base), RankContext(), "TS", {}).limit_val_batches == 1.0
