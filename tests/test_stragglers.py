"""The straggler rules (ae.stragglers): scores against the median, the cause and its evidence."""

from __future__ import annotations

import pytest

from ae.stragglers import MIN_STEPS, NOT_READING, RankTiming, Window, WorkerRate, judge, scores


def timing(rank: int, data: float, compute: float, steps: int = 100, **worker) -> RankTiming:
    window = Window(30.0, steps, data + compute + 5, data + compute, data, compute, 5.0)
    workers = (WorkerRate(0, 100 + rank, f"/d/{rank}.tar", worker.get("mb", 50.0),
                          worker.get("ms", 1.0), 10),)  # fmt: skip
    return RankTiming(rank, window, workers)


def test_scores_are_relative_to_the_median() -> None:
    runs = {0: timing(0, 1, 9), 1: timing(1, 1, 9), 2: timing(2, 21, 9)}
    assert scores(runs) == pytest.approx({0: 1.0, 1: 1.0, 2: 3.0})


def test_each_rank_is_scored_against_the_others() -> None:
    """Two ranks: a rank twice as slow as its peer scores 2.0 (the median of both would give
    1.33, under the default factor)."""
    assert scores({0: timing(0, 1, 9), 1: timing(1, 11, 9)}) == pytest.approx({0: 0.5, 1: 2.0})
    # an even number of others: the lower middle one is the median
    three = {0: timing(0, 1, 9), 1: timing(1, 1, 11), 2: timing(2, 1, 29)}
    assert scores(three) == pytest.approx({0: 10 / 12, 1: 1.2, 2: 3.0})


def test_ranks_without_enough_steps_are_not_scored() -> None:
    runs = {0: timing(0, 1, 9), 1: timing(1, 1, 9, steps=MIN_STEPS - 1), 2: timing(2, 1, 19)}
    assert set(scores(runs)) == {0, 2}
    assert scores({0: timing(0, 1, 9)}) == {}  # one rank: nothing to compare with
    assert scores({0: RankTiming(0, None), 1: timing(1, 1, 9)}) == {}


def test_data_cause_names_the_slowest_worker_of_the_rank() -> None:
    runs = {0: timing(0, 1, 9), 1: timing(1, 1, 9, mb=60.0), 2: timing(2, 40, 9, mb=0.5, ms=52.0)}
    j = judge(2, runs)
    assert j is not None and j.cause == "data" and j.score == pytest.approx(4.9)
    assert j.evidence == (
        "82% of it waiting for data; worker 0 reads /d/2.tar at 0.50 MB/s, 52.0 ms per batch "
        "(other ranks' workers 55 MB/s, 1.0 ms)"
    )


def test_data_cause_with_workers_that_read_fast() -> None:
    """The rank waits 40 ms per step, its workers make a batch in 1 ms: they are held up
    between batches (stopped, starved of CPU), not by their reading."""
    runs = {0: timing(0, 1, 9), 1: timing(1, 40, 9, mb=50.0, ms=1.0)}
    j = judge(1, runs)
    assert j is not None and j.cause == "data"
    assert j.evidence.endswith(f"1.0 ms per batch (other ranks' workers 50 MB/s, 1.0 ms); "
                               f"{NOT_READING}")  # fmt: skip
    slow_reader = judge(1, {0: timing(0, 1, 9), 1: timing(1, 40, 9, mb=0.5, ms=52.0)})
    assert slow_reader is not None and NOT_READING not in slow_reader.evidence


def test_compute_cause() -> None:
    runs = {0: timing(0, 1, 9), 1: timing(1, 1, 9), 2: timing(2, 1, 29)}
    j = judge(2, runs)
    assert j is not None and j.cause == "compute"
    assert j.evidence == "compute 29.0 ms per step (median 9.0 ms); 3% of it waiting for data"
    assert judge(7, runs) is None


def test_from_heartbeat_reads_what_the_heartbeat_writes_and_tolerates_old_ones() -> None:
    raw = {
        "rank": 1,
        "timing": {"recent": {"window_s": 30.0, "steps": 12, "step_ms": 9.0, "own_ms": 6.0,
                              "data_ms": 2.0, "compute_ms": 4.0, "sync_ms": 3.0}, "epoch": None},
        "data_workers": [{"worker": 0, "pid": 7, "shard": "/a.tar", "mb_per_s": 1.5,
                          "batch_ms": 3.0, "batches": 4}, {"bad": 1}],
    }  # fmt: skip
    t = RankTiming.from_heartbeat(raw)
    assert t == RankTiming(1, Window(30.0, 12, 9.0, 6.0, 2.0, 4.0, 3.0),
                           (WorkerRate(0, 7, "/a.tar", 1.5, 3.0, 4),))  # fmt: skip
    assert RankTiming.from_heartbeat({"rank": 1}) is None  # written before step times existed
    raw["timing"] = {"recent": None, "epoch": None}
    assert RankTiming.from_heartbeat(raw).recent is None  # type: ignore[union-attr]
