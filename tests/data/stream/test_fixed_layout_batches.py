"""The columnar fast path gives the general path's batches, and takes no shard that lies.

The general path here is `--tar_reader=tarfile` (the reference reader, which never takes the
columnar path); shards are written by WebDataset's own `TarWriter` (a pax header per member),
indexed by `ae.data.shards.index`, as `ae-shards index` does.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
import webdataset as wds
from loguru import logger

from ae.data.decoding.decode import SampleDecoder
from ae.data.planning.shuffle_order import shuffled_order
from ae.data.shards.index import write_index
from ae.data.shards.tar_header_count import count_samples, scan_shard
from ae.data.stream.resume import ResumableLoader
from ae.data.stream.shard_stream import ShardStream
from ae.data.stream.stages import shuffle_samples
from ae.data.stream.worker_stats import SHARD
from ae.log_lines import SHARD_PATH

DIM = 8


def _write(
    path: Path, rows: list[np.ndarray], start: int, index: bool = True, extra_from: int = -1
) -> str:
    """A shard of `rows` (field `x.npy`, and `cls`); samples from `extra_from` on get `txt`."""
    with wds.TarWriter(str(path)) as sink:
        for i, row in enumerate(rows):
            sample = {"__key__": f"{start + i:08d}", "x.npy": row, "cls": str(i % 3)}
            if 0 <= extra_from <= i:
                sample["txt"] = "another member"
            sink.write(sample)
    if index:
        scan = scan_shard(str(path))
        write_index(path, scan.samples, scan.offsets)
    return str(path)


def _rows(n: int, start: int) -> list[np.ndarray]:
    # the first value is the sample's number: batches say which samples they hold
    return [np.r_[start + i, np.arange(1, DIM)].astype(np.float32) for i in range(n)]


def _shards(tmp_path: Path, sizes: list[int]) -> list[str]:
    urls, start = [], 0
    for s, n in enumerate(sizes):
        urls.append(_write(tmp_path / f"v-{s:06d}.tar", _rows(n, start), start))
        start += n
    return urls


def _stream(
    urls: list[str], reader: str, workers: int, epoch: int = 0, ranks: int = 2
) -> ShardStream:
    return ShardStream(
        split="train", urls=urls, counts=[count_samples(u) for u in urls],
        decoder=SampleDecoder((("x.npy", None),), "vector", (DIM,)), batch_size=4, rank=ranks - 1,
        world_size=ranks, num_workers=workers, shuffle_buffer=10, tar_reader=reader, seed=5,
        epoch=epoch, debug=True,
    )  # fmt: skip


def _loader(
    urls: list[str], reader: str, workers: int, epoch: int = 0, persistent: bool = False
) -> ResumableLoader:
    stream = _stream(urls, reader, workers, epoch)
    return ResumableLoader(
        stream, num_workers=workers, batch_size=None, persistent_workers=persistent
    )


def _batches(loader: ResumableLoader) -> list[torch.Tensor]:
    return [b.clone() for b in loader]


@pytest.fixture
def paths() -> Iterator[list[dict[str, str]]]:
    """The SHARD_PATH lines logged in this process (0 workers)."""
    lines: list[dict[str, str]] = []
    sink = logger.add(lambda m: lines.append(SHARD_PATH.parse(m.record["message"])), level=0)
    yield lines
    logger.remove(sink)


def _taken(lines: list[dict[str, str] | None]) -> set[str]:
    return {line["path"] for line in lines if line is not None}


def test_shuffled_order_is_the_shuffle_buffers_order() -> None:
    for n, bufsize in [(0, 10), (7, 10), (10, 10), (11, 10), (5000, 1000), (300, 1), (40, 2)]:
        a, b = random.Random(n), random.Random(n)
        assert shuffled_order(n, bufsize, a).tolist() == list(shuffle_samples(range(n), bufsize, b))
        assert a.random() == b.random()  # the rng is left where the buffer leaves it


@pytest.mark.parametrize("workers", [0, 2])
def test_same_batches_as_the_general_path_across_epochs_and_a_resume(
    tmp_path: Path, workers: int, paths
) -> None:
    urls = _shards(tmp_path, [37, 25, 30, 19])
    per_epoch = []
    for epoch in (0, 1):
        general = _batches(_loader(urls, "tarfile", workers, epoch))
        no_columns = _loader(urls, "fast", workers, epoch)
        no_columns.dataset.columnar = False  # the fast reader's general path
        assert all(torch.equal(a, b) for a, b in zip(_batches(no_columns), general, strict=True))
        paths.clear()
        fast = _batches(_loader(urls, "fast", workers, epoch))
        assert len(fast) == len(general) == 13
        assert all(torch.equal(a, b) for a, b in zip(fast, general, strict=True))
        if workers == 0:
            assert _taken(paths) == {"columnar"}
        firsts = torch.cat(fast)[:, 0]
        assert len(set(firsts.tolist())) == len(firsts)  # no sample twice
        per_epoch.append(fast)
    assert not torch.equal(per_epoch[0][0], per_epoch[1][0])
    # workers that persist across epochs (the run's loader) follow the rank's epoch
    persistent = _loader(urls, "fast", workers, persistent=workers > 0)
    for epoch in (0, 1):
        persistent.dataset.epoch = epoch
        got = _batches(persistent)
        assert all(torch.equal(a, b) for a, b in zip(got, per_epoch[epoch], strict=True))
    # epoch 1 differs from epoch 0, and a resume mid-epoch 1 continues it exactly
    for k in (1, 6):
        resumed = _loader(urls, "fast", workers)
        resumed.resume({"epoch": 1, "batches": k})
        rest = _batches(resumed)
        assert all(torch.equal(a, b) for a, b in zip(rest, fast[k:], strict=True))
        assert len(rest) == 13 - k


def _mixed_shard(tmp_path: Path, index: bool, change: str) -> list[str]:
    """Shard 1 changes its layout at sample 12: `size` (one more member: later samples move),
    or `same_size` (int32 rows: every byte in the same place, another .npy header)."""
    rows = _rows(26, 40)
    if change == "same_size":
        rows[12:] = [r.astype(np.int32) for r in rows[12:]]
    extra = 12 if change == "size" else -1
    return [
        _write(tmp_path / "v-000000.tar", _rows(40, 0), 0),
        _write(tmp_path / "v-000001.tar", rows, 40, index=index, extra_from=extra),
    ]


@pytest.mark.parametrize(
    ("index", "change"),
    [(True, "size"), (False, "size"), (False, "same_size"), (True, "same_size")],
)
def test_a_layout_change_mid_shard_is_read_by_the_general_path(
    tmp_path: Path, index: bool, change: str, paths
) -> None:
    urls = _mixed_shard(tmp_path, index, change)
    general = _batches(ResumableLoader(_stream(urls, "tarfile", 0, ranks=1), batch_size=None))
    paths.clear()
    fast = _batches(ResumableLoader(_stream(urls, "fast", 0, ranks=1), batch_size=None))
    assert all(torch.equal(a, b) for a, b in zip(fast, general, strict=True))
    assert len(fast) == len(general) == 16
    lines = [line for line in paths if line is not None]
    mixed = [line for line in lines if line["url"] == urls[1]]
    assert mixed and all(line["path"] == "general" for line in mixed)
    assert "sample 12 is not laid out like sample 0" in mixed[0]["why"]
    # the int32 values are read as ints (converted), never as float32 bit patterns
    values = torch.cat(fast)
    assert values.abs().max() < 100 and values[:, 1:].eq(torch.arange(1, DIM)).all()


def test_a_shard_cut_short_is_a_bad_shard_on_the_general_path(tmp_path: Path, paths) -> None:
    urls = _shards(tmp_path, [30, 30])
    size = Path(urls[1]).stat().st_size
    with open(urls[1], "r+b") as f:  # cut inside sample 20; its index now looks stale
        f.truncate(size // 30 * 20 + 700)
    stream = _stream(urls, "fast", 0)
    stream.counts = [30, 30]  # as counted before the cut (a cached count)
    batches = _batches(ResumableLoader(stream, batch_size=None))
    assert len(batches) == 7  # the planned batches, filled with replacements
    assert stream.errors.table[0].tolist()[1] >= 1  # a bad shard read was counted
    assert "general" in _taken(paths)


def test_a_worker_names_the_shard_each_columnar_batch_comes_from(tmp_path: Path) -> None:
    """A shuffled columnar batch draws on every shard of the slot: the worker's row (heartbeat,
    STRAGGLER evidence) names the shard of each batch's first sample, not the slot's first shard
    all epoch long."""
    sizes = [12, 12, 12]
    stream = _stream(_shards(tmp_path, sizes), "fast", workers=0, ranks=1)
    shard_of = np.repeat(np.arange(len(sizes)), sizes)  # sample number -> its shard
    named = []
    for batch in stream:
        named.append(int(stream.stats.table[0, SHARD]))
        assert named[-1] == shard_of[int(batch[0, 0])]
    assert len(named) == sum(sizes) // 4 and len(set(named)) > 1, named


def test_a_shard_mapped_again_is_not_checked_again(tmp_path: Path, monkeypatch) -> None:
    """A rank reading more shards than it keeps mapped (0 workers, a large set) maps them again
    every epoch: the samples checked in the first are not checked again."""
    from ae.data.stream import fixed_layout_batches as fixed

    urls = _shards(tmp_path, [40, 40, 40])
    monkeypatch.setattr(fixed, "MAX_MAPPED_BYTES", 1)  # one shard mapped at a time
    monkeypatch.setattr(fixed, "MAPPED_SHARDS", {})
    monkeypatch.setattr(fixed, "CHECKED", {})
    checks: list[int] = []
    check = fixed.check_samples
    monkeypatch.setattr(
        fixed, "check_samples", lambda *a: checks.append(a[2]) or check(*a)
    )  # fmt: skip
    stream = _stream(urls, "fast", 0, ranks=1)  # one rank: every epoch reads every sample
    loader = ResumableLoader(stream, num_workers=0, batch_size=None)
    first = _batches(loader)
    assert checks and len(fixed.MAPPED_SHARDS) == 1  # every slice checked; the maps dropped
    checks.clear()
    loader.dataset.epoch = 1
    assert len(_batches(loader)) == len(first)
    assert checks == []
