"""The read-ahead thread: the same batches in the same order, read on another thread, its errors
raised in the consumer, and a consumer that leaves stops it."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from types import SimpleNamespace

import pytest

from ae.data.stream.read_ahead import read_ahead
from ae.data.stream.resume import ResumableLoader


def _counting(produced: list[str], n: int | None = None) -> Iterator[int]:
    i = 0
    while n is None or i < n:
        produced.append(threading.current_thread().name)
        yield i
        i += 1


def test_the_same_items_in_order_read_on_another_thread() -> None:
    produced: list[str] = []
    started: list[str] = []
    out = list(read_ahead(_counting(produced, 50), on_start=lambda: started.append("x")))
    assert out == list(range(50))
    assert set(produced) == {"ae-read-ahead"} and started == ["x"]


def test_reads_at_most_depth_ahead() -> None:
    produced: list[str] = []
    it = read_ahead(_counting(produced), depth=2)
    assert next(it) == 0
    time.sleep(0.3)  # room for the thread to run ahead as far as it may
    # the item handed over, two queued, one read and waiting for room
    assert len(produced) == 4
    it.close()


def test_the_sources_error_is_raised_in_the_consumer_after_its_items() -> None:
    class BadShard(Exception):
        pass

    def source() -> Iterator[int]:
        yield 1
        yield 2
        raise BadShard("shard 7 is truncated")

    got = []
    with pytest.raises(BadShard, match="shard 7"):
        for x in read_ahead(source()):
            got.append(x)
    assert got == [1, 2]


def test_a_consumer_that_leaves_stops_the_thread() -> None:
    produced: list[str] = []
    it = read_ahead(_counting(produced), depth=3)
    assert [next(it) for _ in range(5)] == list(range(5))
    it.close()  # what Lightning's leaving an epoch early does to the loader's generator
    n = len(produced)
    time.sleep(0.3)
    assert len(produced) == n <= 5 + 3 + 1
    assert not any(t.name == "ae-read-ahead" for t in threading.enumerate())


def test_the_train_loader_reads_ahead_only_in_process_and_pinned() -> None:
    def loader(workers: int, pin: bool) -> ResumableLoader:
        stream = SimpleNamespace(released=None, reuses_buffers=True)  # never iterated
        return ResumableLoader(stream, batch_size=None, num_workers=workers, pin_memory=pin)

    assert loader(0, True).reads_ahead
    assert not loader(2, True).reads_ahead
    assert not loader(0, False).reads_ahead
