"""What bounds a job (data, compute or sync) from its ranks' step clocks, and the advice an
input-bound job gets: the train log's `Throughput epoch` line (`ae.stragglers`, last section)."""

from __future__ import annotations

from ae.log_lines import THROUGHPUT
from ae.stragglers import RankSplit, bound_of, epoch_line, input_advice


def test_an_input_bound_run_is_named_with_the_flag_that_feeds_it() -> None:
    # 2 ranks, 20 steps each: 140 ms of data wait and 9 ms of compute per step (a 2-rank CPU run
    # with AE_FAULT=slow@data:ms=150 and --num_workers=1 measured 94%)
    rows = [(20, 2.8, 0.18, 0.12), (20, 2.7, 0.2, 0.2)]
    line = epoch_line(0, rows, 64, num_workers=1, local_ranks=2, cpus=8)
    assert line is not None
    m = THROUGHPUT.parse(line)
    assert m is not None and m["epoch"] == "0"
    assert float(m["step_ms"]) == 155.0  # the slowest rank (0): 140 + 9 + 6 ms
    assert float(m["samples_per_s"]) == round(64 / 0.155)  # 2 ranks x 32 per step
    assert m["split"] == "slowest rank 0: data wait 140.0, compute 9.0, sync 6.0 ms"
    assert m["verdict"].startswith("input-bound: rank 0 waits for data 94% of its own time")
    assert "raise --num_workers (now 1 per rank, 8 CPUs for 2 ranks here)" in m["verdict"]


def test_no_workers_and_every_cpu_taken_get_their_own_advice() -> None:
    assert "--num_workers=0): give it workers" in input_advice(0, 1, 8)
    full = input_advice(4, 2, 8)  # 4 workers x 2 ranks on 8 CPUs: more would not help
    assert "already fill the 8 CPUs" in full and "raise --num_workers" not in full
    assert "helps only while they wait on storage" in full
    assert "raise --num_workers (now 2 per rank)" in input_advice(2, None, None)


def test_a_compute_bound_run_gets_no_data_advice() -> None:
    # 1 rank, the 2-rank figures of a 3.5M-parameter conv at 256 px: 2.66 s a step, 7% data
    line = epoch_line(0, [(40, 7.6, 98.8, 0.08)], 8, num_workers=0, local_ranks=1, cpus=2)
    assert line is not None
    m = THROUGHPUT.parse(line)
    assert m is not None
    assert m["split"] == "data wait 190.0, compute 2470.0, sync 2.0 ms"  # no `slowest rank`
    assert m["verdict"] == "compute-bound: the rank waits for data 7% of its own time"
    assert "num_workers" not in line


def test_the_pace_is_set_by_the_rank_with_the_longest_own_time() -> None:
    # rank 0 fast and waiting for rank 1 (sync); rank 1 waits for its data: the job is input-bound
    splits = [RankSplit(0, 2.0, 6.0, 75.0), RankSplit(1, 76.0, 6.0, 4.0)]
    bound = bound_of(splits)
    assert bound is not None and (bound.rank, bound.bound) == (1, "input")
    # every rank computes little and waits for the all-reduce: sync-bound
    bound = bound_of([RankSplit(0, 1.0, 5.0, 20.0), RankSplit(1, 1.0, 5.5, 19.0)])
    assert bound is not None and bound.bound == "sync" and bound.rank == 1
    assert bound_of([]) is None and epoch_line(0, [(0, 0.0, 0.0, 0.0)], 32) is None
