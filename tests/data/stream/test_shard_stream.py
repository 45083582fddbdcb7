"""ShardStream in one process: exact samples per slot, per-epoch order, bad data replaced."""

from __future__ import annotations

import socket
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from loguru import logger

import ae.data.stream.shard_stream as dataset
from ae.data.planning.plan import plan_epoch
from ae.data.shards.errors import DataError
from ae.data.shards.index import read_index
from ae.data.shards.writer import write_shard
from ae.data.stream.worker_stats import SHARD_BYTES
from tests.support.id_streams import DIM
from tests.support.id_streams import id_sample as _sample
from tests.support.id_streams import make_stream as _stream
from tests.support.id_streams import read_ids as _read
from tests.support.id_streams import write_id_shards as _write
from tests.support.shards import vector_decoder


@pytest.fixture
def errors() -> list[str]:
    messages: list[str] = []
    sink = logger.add(lambda m: messages.append(m.record["message"]), level="ERROR")
    yield messages
    logger.remove(sink)


def test_every_slot_reads_exactly_its_planned_samples(tmp_path: Path, monkeypatch) -> None:
    sizes = [10, 10, 10, 10, 3]
    urls = _write(tmp_path, sizes)
    starts = np.concatenate([[0], np.cumsum(sizes)])
    plan = plan_epoch(sizes, world_size=2, num_workers=2, batch_size=4, seed=3, epoch=1)
    seen: list[int] = []
    for rank in (0, 1):
        per_rank = 0
        for worker in (0, 1):
            stream = _stream(
                urls, sizes, rank=rank, world_size=2, num_workers=2, shuffle=True, seed=3, epoch=1
            )
            got = _read(stream, worker, monkeypatch)
            expected = [
                int(starts[s.shard]) + i
                for s in plan.slot_slices(rank, worker)
                for i in range(s.start, s.stop)
            ]
            assert sorted(got) == sorted(expected)  # shuffled, but exactly the planned samples
            per_rank += len(got)
            seen += got
        assert per_rank == plan.batches_per_rank * 4 == 20
    assert len(seen) == len(set(seen)) == 40  # drop mode: no sample twice, 3 dropped


def test_order_changes_per_epoch_and_repeats_per_epoch(tmp_path: Path, monkeypatch) -> None:
    urls = _write(tmp_path, [20, 20, 20])

    def order(epoch: int) -> list[int]:
        stream = _stream(urls, [20, 20, 20], shuffle=True, shuffle_buffer=16, epoch=epoch)
        return _read(stream, 0, monkeypatch)

    assert order(0) == order(0)  # a restart (or a fresh non-persistent worker) replays it
    assert order(0) != order(1) and sorted(order(0)) == sorted(order(1))


@pytest.mark.parametrize(
    ("reader", "expected_error"),
    [("fast", "TruncatedTar: stream ends inside a member"), ("tarfile", "ReadError")],
)
def test_bad_samples_and_truncated_shard_are_logged_and_replaced(
    tmp_path: Path, monkeypatch, errors: list[str], reader: str, expected_error: str
) -> None:
    urls = _write(tmp_path, [10, 10, 10])
    bad = [_sample(i) for i in range(10, 20)]
    bad[5] = {"__key__": b"00000015", "npy": b"\x93NUMPY garbage"}
    bad[7] = _sample(17, dim=DIM + 1)  # decodes, wrong shape
    write_shard(Path(urls[1]), bad)
    data = Path(urls[2]).read_bytes()
    Path(urls[2]).write_bytes(data[: 6 * 1024 + 600])  # cut in sample 6: planned 10, 6 left

    stream = _stream(urls, [10, 10, 10], batch_size=5, tar_reader=reader)
    got = _read(stream, 0, monkeypatch)
    assert len(got) == 30  # the planned 6 batches of 5, whatever broke
    good = set(range(26)) - {15, 17}
    assert set(got) <= good and good <= set(got)  # every good sample, replacements are good ones
    assert len(errors) == 3
    assert errors[0].startswith(f"Bad sample 00000015 in shard {urls[1]}: cannot decode .npy")
    assert errors[1] == f"Bad sample 00000017 in shard {urls[1]}: shape (5,), expected (4,)"
    assert errors[2].startswith(f"Bad shard {urls[2]}: {expected_error}")
    assert errors[2].endswith("(after sample 00000025; 4 of 10 planned samples lost)")
    assert stream.errors.totals() == (2, 1, 6)  # bad samples, bad shard reads, replaced


def test_slot_with_no_good_sample_borrows_from_other_shards(tmp_path: Path, monkeypatch) -> None:
    urls = _write(tmp_path, [8, 8])
    Path(urls[0]).write_bytes(b"junk" * 1000)
    stream = _stream(urls, [8, 8], num_workers=2)
    assert set(_read(stream, 0, monkeypatch)) <= set(range(8, 16))  # its shard was junk
    assert len(_read(stream, 0, monkeypatch)) == 8


def test_no_readable_sample_anywhere_names_the_split(tmp_path: Path, monkeypatch) -> None:
    urls = _write(tmp_path, [4, 4])
    for url in urls:
        Path(url).write_bytes(b"junk" * 1000)
    with pytest.raises(DataError, match="train_shards: no readable sample in any of 2 shards") as e:
        _read(_stream(urls, [4, 4]), 0, monkeypatch)
    # The shard that failed last, and how (it said only "no readable sample")
    assert f"has nothing to train on); last problem: {urls[1]}: " in str(e.value)


def test_remote_shards_that_all_fail_mid_run_say_what_failed_and_what_to_do(
    monkeypatch,
) -> None:
    """The server of the shards killed in epoch 3: every rank stopped with `no readable sample in
    any of 8 shards (rank 0 slot 0 has nothing to train on)`, as if the data were bad."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # released: nothing listens there
    urls = [f"http://127.0.0.1:{port}/train-00000{i}.tar" for i in range(2)]
    with pytest.raises(DataError) as e:
        _read(_stream(urls, [4, 4]), 0, monkeypatch)
    assert str(e.value).endswith(
        f"has nothing to train on); last problem: {urls[1]}: ShardCommandError: could not "
        "download it: curl exit 7 (could not connect to the server: nothing listening, or a "
        "firewall); once the shards' source answers again, --resume_from_checkpoint=last goes on"
    )


def test_pipe_shard_left_mid_way_is_no_error(tmp_path: Path, monkeypatch, errors) -> None:
    """A slot that stops inside a pipe: shard closes the pipe early; the command then fails on
    SIGPIPE (`|| exit 3` stands for tools like `aws s3 cp` that exit non-zero then)."""
    big = 16384  # 64 KiB samples: more than a pipe buffer, so `cat` is still writing
    urls = [f"pipe:cat {u} || exit 3" for u in _write(tmp_path, [10], dim=big)]
    decoder = vector_decoder(big)
    for rank, expected in ((0, [0, 1, 2, 3]), (1, [4, 5, 6, 7])):
        stream = _stream(urls, [10], decoder=decoder, batch_size=2, world_size=2, rank=rank)
        assert _read(stream, 0, monkeypatch) == expected
    assert errors == []


def test_worker_read_rates(tmp_path: Path, monkeypatch) -> None:
    """Each worker's row: the shard it reads now, bytes/s from it, time per batch, and only the
    time producing batches counts (not the time its batches wait to be taken)."""
    urls = _write(tmp_path, [16, 16])
    stream = _stream(urls, [16, 16], num_workers=2)
    assert stream.worker_rates() == []  # no worker has produced a batch yet
    info = SimpleNamespace(id=1, num_workers=2)
    monkeypatch.setattr(dataset, "get_worker_info", lambda: info)
    for _ in stream:
        time.sleep(0.05)  # the consumer is slow: not the worker's time
    (row,) = stream.worker_rates()
    assert (row["worker"], row["shard"], row["batches"]) == (1, urls[1], 4)  # slot 1: shard 1
    assert row["batch_ms"] < 50 and row["mb_per_s"] > 0
    # every byte of the shard's samples was read (the columnar path: not the end-of-archive
    # blocks), and counted against it
    offsets = read_index(urls[1], with_offsets=True).offsets
    assert stream.stats.table[1, SHARD_BYTES] == 16 * offsets[1]
