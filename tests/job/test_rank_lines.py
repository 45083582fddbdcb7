"""The launcher's console says what the other ranks (and every dataloader worker) wrote to the
train log: errors (a burst, then a count), data-error summaries, the first line of each stall."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from loguru import logger

from ae.job.rank_lines import BURST, HOLD_S, RECORD_LINES, WINDOW_S, RankLines
from ae.log_lines import BAD_SAMPLE, DATA_ERRORS, FATAL, NONFINITE, RESOURCE_TIGHT, STALL
from bench.synthetic_logs import T0, record


@pytest.fixture
def said() -> Iterator[list[str]]:
    out: list[str] = []
    sink = logger.add(lambda m: out.append(f"{m.record['level'].name} {m.record['message']}"))
    yield out
    logger.remove(sink)


def _stall(step: int, report: int, phase: str = "training step") -> str:
    return STALL.format(idle="3.1", phase=phase, epoch=0, step=step, report=report,
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
    assert said == [f"WARNING rank 1: {_stall(5, 1)}"]  # the errors wait for rank 0's own
    said.clear()
    follower.poll(now=HOLD_S)
    assert said == [f"ERROR rank 1 worker 0: {b}" for b in bad[:BURST]]
    # What the console holds, for the launcher's last words: not the lines only counted
    assert follower.said == {"rank 0's own error", *bad[:BURST]}
    said.clear()
    summary = DATA_ERRORS.format(split="train", bad_samples=5, bad_shards=0, replaced=5)
    with log.open("a") as f:  # the rest of the half line, then more
        f.write(lines[0][20:] + "\n" + record(T0, "WARNING", 1, 2, summary) + "\n")
        f.write(record(T0, "WARNING", 1, 2, _stall(9, 3)) + "\n")  # a new stall
    follower.poll(now=HOLD_S + WINDOW_S + 1)  # the window closed: the held lines are counted
    assert said == [
        f"WARNING rank 1: {summary}",
        f"WARNING rank 1: {_stall(9, 3)}",
        "ERROR rank 1 worker 0: 2 more errors (all in train_TS.log)",
    ]
    said.clear()
    follower.finish()
    assert said == []


def test_an_error_every_rank_logs_is_said_once(tmp_path: Path, said: list[str]) -> None:
    """A user error found alike by every rank: rank 0 says it; the others' copies, whichever
    comes first in the log, are not repeated; another rank's own error still is, once."""
    log = tmp_path / "train_TS.log"
    log.write_text(
        "\n".join([
            record(T0, "ERROR", 1, 3, "val_shards: no readable sample"),  # before rank 0's
            record(T0, "ERROR", 2, 3, "rank 2 alone"),
            record(T0, "ERROR", 0, 3, "val_shards: no readable sample"),
            record(T0, "ERROR", 1, 3, "rank 2 alone"),
        ]) + "\n"
    )  # fmt: skip
    follower = RankLines(log)
    follower.poll(now=0.0)
    assert said == []
    follower.finish()
    assert said == ["ERROR rank 2: rank 2 alone"]


def test_a_nonfinite_line_is_said_at_once(tmp_path: Path, said: list[str]) -> None:
    """A NONFINITE line names its own rank (rank 0 never writes the same text): it does not wait
    for rank 0's copy. Under --on_nonfinite=skip the run goes on, and ended before the hold did:
    the line came after `Training finished`."""
    line = NONFINITE.format(value="loss=nan", rank=1, step=6, epoch=0, batch="5",
                            samples="shard /d/a-000000.tar, keys [k1, k2]")  # fmt: skip
    log = tmp_path / "train_TS.log"
    log.write_text(record(T0, "ERROR", 1, 2, line) + "\n")
    follower = RankLines(log)
    follower.poll(now=0.0)
    assert said == [f"ERROR rank 1: {line}"]
    follower.finish()
    assert said == [f"ERROR rank 1: {line}"]


def test_another_ranks_error_of_several_lines_is_said_whole(
    tmp_path: Path, said: list[str]
) -> None:
    """A message whose reason is on its second line keeps it on the console; a record past
    RECORD_LINES lines (a traceback) is said in part, with where the rest is, and is not among
    the messages said whole (the launcher's last words may say it again)."""
    reason = ["val_shards: no readable sample in 3 shards", "  reason: no sample decodes"]
    long = [f"line {i}" for i in range(RECORD_LINES + 5)]
    log = tmp_path / "train_TS.log"
    log.write_text(
        "\n".join([
            record(T0, "ERROR", 1, 2, reason[0]), *reason[1:],
            record(T0, "ERROR", 1, 2, long[0]), *long[1:],
            record(T0, "INFO", 1, 2, "the next record"),
        ]) + "\n"
    )  # fmt: skip
    follower = RankLines(log)
    follower.finish()
    cut = [*long[:RECORD_LINES], f"... 5 more lines in {log.name}"]
    assert said == ["ERROR rank 1: " + "\n".join(reason), "ERROR rank 1: " + "\n".join(cut)]
    assert follower.said == {"\n".join(reason)}


def test_rank_0s_error_of_several_lines_is_not_said_again(tmp_path: Path, said: list[str]) -> None:
    """Rank 0 said its own record whole; another rank's copy of the whole message is not said."""
    message = ["train_shards: 2 shards unreadable", "  /d/a-000000.tar: truncated"]
    log = tmp_path / "train_TS.log"
    log.write_text(
        "\n".join([
            record(T0, "ERROR", 0, 2, message[0]), *message[1:],
            record(T0, "ERROR", 1, 2, message[0]), *message[1:],
        ]) + "\n"
    )  # fmt: skip
    follower = RankLines(log)
    follower.finish()
    assert said == [] and follower.said == {"\n".join(message)}


def test_another_nodes_tight_limit_is_said(tmp_path: Path, said: list[str]) -> None:
    """Each node's local rank 0 reckons its node's limits; only rank 0 has a console."""
    tight = RESOURCE_TIGHT.format(problem="host memory: 22.0 GB available, the run needs ...")
    log = tmp_path / "train_TS.log"
    log.write_text(
        record(T0, "WARNING", 0, 4, tight) + "\n" + record(T0, "WARNING", 2, 4, tight) + "\n"
    )
    follower = RankLines(log)
    follower.finish()
    assert said == [f"WARNING rank 2: {tight}"]


def test_rank_0s_message_is_not_the_last_word_after_relayed_lines(
    tmp_path: Path, said: list[str]
) -> None:
    """Rank 0's workers' bad samples, written before rank 0's stop message, wait HOLD_S and
    come out after it: the launcher's last words must say rank 0's message again; another
    rank's copy of it is still not said."""
    bad = BAD_SAMPLE.format(key="00000001", url="/d/a-000000.tar", reason="no field x.npy")
    stop = "train_shards: more than --max_bad_fraction=0.01 of epoch 0's samples were bad"
    log = tmp_path / "train_TS.log"
    log.write_text(
        "\n".join([
            record(T0, "ERROR", 0, 2, bad, worker="0/1"),
            record(T0, "ERROR", 0, 2, stop),
            record(T0, "ERROR", 1, 2, stop),
        ]) + "\n"
    )  # fmt: skip
    follower = RankLines(log)
    follower.poll(now=0.0)
    assert said == [] and follower.last_words_said == {stop}
    follower.finish()
    assert said == [f"ERROR rank 0 worker 0: {bad}"]
    assert follower.last_words_said == {bad}


def test_a_stall_that_goes_on_in_teardown_after_ctrl_c_is_said_once(
    tmp_path: Path, said: list[str]
) -> None:
    """README's hang, then Ctrl-C: rank 1, stalled in data loading, goes to teardown and stays
    stuck on the same sleeping worker; its next STALL report (phase teardown, same step) was
    said on the console as a new stall after the Ctrl-C. A stall at another step still is."""
    log = tmp_path / "train_TS.log"
    lines = [
        record(T0, "WARNING", 1, 2, _stall(3, 1, "data loading")),
        record(T0, "WARNING", 1, 2, _stall(3, 4, "teardown")),
        record(T0, "WARNING", 1, 2, _stall(7, 5, "teardown")),
    ]
    log.write_text("\n".join(lines) + "\n")
    RankLines(log).poll(now=0.0)
    assert said == [f"WARNING rank 1: {_stall(3, 1, 'data loading')}",
                    f"WARNING rank 1: {_stall(7, 5, 'teardown')}"]  # fmt: skip
