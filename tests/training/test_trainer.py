"""The trainer refuses a precision its device cannot do, rather than running another."""

from __future__ import annotations

import pytest

from ae.config import ConfigError, RunConfig
from ae.training.trainer import check_precision


def test_16_mixed_on_a_cpu_is_refused_not_replaced_by_bf16() -> None:
    with pytest.raises(ConfigError, match=r"precision: 16-mixed needs a GPU.*--precision=32"):
        check_precision(RunConfig(precision="16-mixed"), "cpu")
    check_precision(RunConfig(precision="bf16-mixed"), "cpu")  # what Lightning runs on a CPU
