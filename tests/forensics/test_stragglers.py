"""The straggler detector on rank 0 (reading heartbeat files) and the other ranks following it,
in-process with heartbeat files written by hand and a clock passed in."""

from __future__ import annotations

import json
from pathlib import Path

from ae.forensics.stragglers import Stragglers
from ae.log_lines import HEARTBEAT_FILE, STRAGGLER, STRAGGLER_RESOLVED
from logging_cfg import RankContext

T0 = 1_800_000_000.0


def beat(logs: Path, rank: int, t: float, own: float, data: float, **more) -> None:
    window = {"window_s": 10.0, "steps": 50, "step_ms": 40.0, "own_ms": own, "data_ms": data,
              "compute_ms": own - data, "sync_ms": 40.0 - own}  # fmt: skip
    record = {"rank": rank, "state": "running", "time": t, "pid": 1000 + rank,
              "timing": {"recent": window, "epoch": window}, "data_workers": [],
              "stragglers": [], **more}  # fmt: skip
    (logs / HEARTBEAT_FILE.format(rank=rank, ts="TS")).write_text(json.dumps(record))


def detector(logs: Path, rank: int = 0, local_rank: int = 0) -> Stragglers:
    ctx = RankContext(rank=rank, world_size=3, local_rank=local_rank)
    return Stragglers(1.3, 10.0, logs, "TS", ctx, max_age_s=10.0)


def test_named_after_the_window_then_resolved(tmp_path: Path, records) -> None:
    det = detector(tmp_path)
    for t in (0, 4, 8, 12):  # rank 2: 3x the median, data-bound, from t=0 on
        for rank in (0, 1):
            beat(tmp_path, rank, T0 + t, own=10.0, data=1.0)
        beat(tmp_path, 2, T0 + t, own=30.0, data=21.0)
        det.check(T0 + t)
        assert bool(det.episodes) == (t >= 10), (t, records)  # only once it lasted the window
    ((level, line),) = records
    m = STRAGGLER.parse(line)
    assert level == "WARNING" and m is not None
    assert (m["rank"], m["score"], m["window"], m["cause"]) == ("2", "3.0", "10", "data")
    assert m["evidence"] == "70% of it waiting for data"
    assert det.episodes[0]["resolved"] is None and det.episodes[0]["since"] == T0

    # resolved once back under the factor for the window too; a dip does not clear it
    for t, own in ((16, 11.0), (20, 30.0), (22, 11.0), (30, 11.0), (32, 11.0)):
        for rank in (0, 1):
            beat(tmp_path, rank, T0 + t, own=10.0, data=1.0)
        beat(tmp_path, 2, T0 + t, own=own, data=1.0)
        det.check(T0 + t)
        assert (det.episodes[0]["resolved"] is None) == (t < 32), (t, records)
    level, line = records[-1]
    assert STRAGGLER_RESOLVED.parse(line) == {"rank": "2", "seconds": "32", "score": "1.1"}
    assert det.episodes[0]["resolved"] == line and len(records) == 2


def test_a_dip_below_the_factor_restarts_the_window(tmp_path: Path, records) -> None:
    det = detector(tmp_path)
    for t, own in ((0, 30.0), (6, 12.0), (12, 30.0), (20, 30.0), (22, 30.0)):
        for rank in (0, 1):
            beat(tmp_path, rank, T0 + t, own=10.0, data=1.0)
        beat(tmp_path, 2, T0 + t, own=own, data=1.0)
        det.check(T0 + t)
    assert [STRAGGLER.parse(line)["cause"] for _, line in records] == ["compute"]  # type: ignore[index]
    assert det.episodes[0]["since"] == T0 + 12


def test_stale_exited_and_old_heartbeats_are_not_judged(tmp_path: Path, records) -> None:
    det = detector(tmp_path)
    beat(tmp_path, 0, T0, own=10.0, data=1.0)
    beat(tmp_path, 1, T0 - 60, own=90.0, data=1.0)  # its writer is gone
    beat(tmp_path, 2, T0, own=90.0, data=1.0, state="exited")
    (tmp_path / HEARTBEAT_FILE.format(rank=3, ts="TS")).write_text('{"rank": 3, "state": "run')
    for t in (0, 20):
        det.check(T0 + t)
    assert records == [] and det.episodes == []


def test_the_slow_rank_copies_its_lines_once(tmp_path: Path, records) -> None:
    episode = {"rank": 2, "score": 3.0, "cause": "data", "since": T0, "line": "STRAGGLER rank 2: x",
               "resolved": None}  # fmt: skip
    beat(tmp_path, 0, T0, own=10.0, data=1.0, stragglers=[episode])
    follower = detector(tmp_path, rank=2, local_rank=2)
    assert follower.detector_rank() == 0
    follower.check()
    follower.check()
    assert records == [("INFO", "STRAGGLER rank 2: x")]
    episode["resolved"] = "STRAGGLER RESOLVED rank 2 after 9s: now 1.0x"
    beat(tmp_path, 0, T0, own=10.0, data=1.0, stragglers=[episode])
    follower.check()
    follower.check()
    assert [m for _, m in records] == ["STRAGGLER rank 2: x", episode["resolved"]]
    other = detector(tmp_path, rank=1, local_rank=1)
    other.check()
    assert len(records) == 2  # rank 1 is not named


def test_without_rank_0_heartbeat_each_node_judges_its_own_ranks(tmp_path: Path) -> None:
    """A node-local logs folder: rank 0's heartbeat is elsewhere."""
    ctx = RankContext(rank=5, world_size=8, local_rank=1, node_rank=1)
    assert Stragglers(1.3, 10.0, tmp_path, "TS", ctx, 10.0).detector_rank() == 4
    beat(tmp_path, 0, T0, own=10.0, data=1.0)
    assert Stragglers(1.3, 10.0, tmp_path, "TS", ctx, 10.0).detector_rank() == 0
