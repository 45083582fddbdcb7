"""The launcher's console says what the other ranks (and every dataloader worker) wrote to the
train log: errors (a burst, then a count), data-error summaries, the first line of each stall."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from loguru import logger

from ae.job.rank_lines import BURST, WINDOW_S, RankLines
from ae.log_lines import BAD_SAMPLE, DATA_ERRORS, FATAL, STALL
from bench.synthetic_logs import T0, record


@pytest.fixture
def said() -> Iterator[list[str]]:
    out: list[str] = []
    sink = logger.add(lambda m: out.append(f"{m.record['level'].name} {m.record['message']}"))
    yield out
    logger.remove(sink)


def _stall(step: int, report: int) -> str:
    return STALL.format(idle="3.1", phase="training step", epoch=0, step=step, report=report,
                        frame="_injected_sleep (ae/forensics/faults.py:163)",
                        collective="no")  # fmt: skip


def test_other_ranks_errors_summaries_and_stalls(tmp_path: Path, said: list[str]) -> None:
    log = tmp_path / "train_TS.log"
    bad = [BAD_SAMPLE.format(key=f"{k:08d}", url="/d/a-000000.tar", reason="cannot decode .npy")
           for k in range(BURST + 2)]  # fmt: skip
    lines = [
        record(T0, "WARNING", 0, 2, _stall(5, 1)),  # rank 0's own: on the console already
        record(T0, "ERROR", 0, 2, "rank 0's own error"),
        *[record(T0, "ERROR", 1, 2, b, worker="0/1") for b in bad],
        record(T0, "CRITICAL", 1, 2, FATAL.format(exc_type="X", where="main thread", message="m")),
        record(T0, "WARNING", 1, 2, _stall(5, 1)),
        record(T0, "WARNING", 1, 2, _stall(5, 2)),  # the same stall again: not said
        record(T0, "WARNING", 1, 2, "Some other warning"),
    ]
    follower = RankLines(log)
    log.write_text("\n".join(lines) + "\n" + lines[0][:20])  # and half a line, still written
    follower.poll(now=0.0)
    assert said == [
        *[f"ERROR rank 1 worker 0: {b}" for b in bad[:BURST]],
        f"WARNING rank 1: {_stall(5, 1)}",
    ]
    said.clear()
    summary = DATA_ERRORS.format(split="train", bad_samples=5, bad_shards=0, replaced=5)
    with log.open("a") as f:  # the rest of the half line, then more
        f.write(lines[0][20:] + "\n" + record(T0, "WARNING", 1, 2, summary) + "\n")
        f.write(record(T0, "WARNING", 1, 2, _stall(9, 3)) + "\n")  # a new stall
    follower.poll(now=WINDOW_S + 1)  # the window closed: the held lines are counted
    assert said == [
        f"WARNING rank 1: {summary}",
        f"WARNING rank 1: {_stall(9, 3)}",
        "ERROR rank 1 worker 0: 2 more ERROR lines (all in train_TS.log)",
    ]
    said.clear()
    follower.finish()
    assert said == []
