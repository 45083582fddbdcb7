"""The loggers' cadence and the per-rank series read from heartbeats."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ae.config import ConfigError, parse_config
from ae.log_lines import HEARTBEAT_FILE
from ae.training.metrics import build_loggers, log_cadence
from ae.training.rank_series import rank_values, read_heartbeats


def test_short_runs_log_often_enough_for_a_train_line() -> None:
    assert [log_cadence(n) for n in (3, 19, 20, 55, 99, 100, 10_000)] == [1, 1, 2, 5, 9, 10, 10]
    assert log_cadence(float("inf")) == 10


def _beat(rank: int, own_ms: float, data_ms: float, rss: float, workers: list[float]) -> dict:
    window = {"window_s": 10.0, "steps": 20, "step_ms": own_ms + 5, "own_ms": own_ms,
              "data_ms": data_ms, "compute_ms": own_ms - data_ms, "sync_ms": 5.0}  # fmt: skip
    return {
        "rank": rank, "state": "running", "rss_mb": rss,
        "workers": [{"pid": 1, "rss_mb": w} for w in workers],
        "timing": {"recent": window, "epoch": window}, "data_workers": [],
    }  # fmt: skip


def test_rank_values_from_heartbeat_files(tmp_path: Path) -> None:
    ts = "20260101_000000"
    for beat in (_beat(0, 10.0, 2.0, 300.0, [100.0]), _beat(1, 20.0, 15.0, 310.0, [])):
        path = tmp_path / HEARTBEAT_FILE.format(rank=beat["rank"], ts=ts)
        path.write_text(json.dumps(beat))
    (tmp_path / HEARTBEAT_FILE.format(rank=2, ts=ts)).write_text("{torn")  # being replaced
    values = rank_values(read_heartbeats(tmp_path, ts))
    assert values == {
        "own_ms_per_step/rank0": 10.0, "data_wait_pct/rank0": pytest.approx(20.0),
        "own_ms_per_step/rank1": 20.0, "data_wait_pct/rank1": pytest.approx(75.0),
        "straggler_score/rank0": 0.5, "straggler_score/rank1": 2.0,
        "rss_mb/rank0": 400.0, "rss_mb/rank1": 310.0,
    }  # fmt: skip


def test_a_logger_that_cannot_start_is_a_config_error(tmp_path: Path) -> None:
    """Raised in the ranks before training: one message naming the logger, exit code 2 (the
    launcher's handling of a rank's ConfigError: tests/e2e/test_runs.py)."""
    pytest.importorskip(
        "mlflow", reason="the mlflow extra is not installed: pip install -e '.[mlflow]'"
    )
    cfg = parse_config(
        [f"--output_dir={tmp_path}", "--logger=csv,mlflow", "--mlflow_tracking_uri=nosuch://x"]
    )
    with pytest.raises(ConfigError) as err:
        build_loggers(cfg.obs, cfg.run.dir, "20260101_000000", {})
    (problem,) = err.value.problems
    assert problem.startswith("logger: mlflow cannot start: ") and "nosuch://x" in problem
    assert err.value.exit_code == 2
