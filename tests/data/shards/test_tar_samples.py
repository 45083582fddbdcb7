"""The fast tar reader gives the same samples, in the same order, as Python's tarfile and as
WebDataset's own pipeline."""

from __future__ import annotations

import io
import re
import tarfile
from pathlib import Path

import numpy as np
import pytest
import torch
import webdataset as wds
from webdataset import tariterators as wds_tariterators

from ae.data.shards.tar_samples import ByteCount, TarReader, iter_samples, split_name
from ae.data.shards.writer import npy_bytes
from ae.data.stream.shard_stream import ShardStream
from tests.support.shards import vector_decoder


def _shard(path: Path, fmt: int) -> str:
    """Multi-field samples, a directory entry, nested and long (>100 chars) member names."""
    rng = np.random.default_rng(0)
    with tarfile.open(path, "w", format=fmt) as tar:
        info = tarfile.TarInfo("somedir")
        info.type = tarfile.DIRTYPE
        tar.addfile(info)
        for i in range(25):
            prefix = ("d" * 110 + "/") if i % 7 == 3 else "sub/"
            for ext, data in (
                ("npy", npy_bytes(rng.random(8, dtype=np.float32))),
                ("cls", str(i).encode()),
                ("meta.json", b"{}" * (i % 5)),
            ):
                member = tarfile.TarInfo(f"{prefix}{i:06d}.{ext}")
                member.size = len(data)
                tar.addfile(member, io.BytesIO(data))
    return str(path)


NAMES = [
    "a/b/000123.seg.png", "000123.npy", "000123.X.NPY", "noext", "dir.x/.hidden", "dir/.hidden",
    ".hidden", "a.b/c.d.e", "a//.x", "abc.", "__meta__", "__index__/a.npy", "__a__.npy",
    "x/__meta__", "ключ/ü.JPG", "d" * 120 + "/n.tar.gz", "a b/c d.e f",
]  # fmt: skip


def _webdataset_split(name: str) -> tuple[str, str] | None:
    """WebDataset's own decision: its meta-name filter, its split, its lowercasing."""
    if ("/" not in name and name.startswith("__") and name.endswith("__")) or re.match(
        r"__[^/]*__($|/)", name
    ):
        return None
    key, ext = wds_tariterators.base_plus_ext(name)
    return None if key is None else (key, ext.lower())


def test_split_name_is_webdatasets() -> None:
    assert split_name("a/b/000123.seg.png") == ("a/b/000123", "seg.png")
    assert split_name("000123.X.NPY") == ("000123", "x.npy")
    assert split_name("noext") is None and split_name("dir.x/.hidden") is None
    for name in NAMES:
        assert split_name(name) == _webdataset_split(name), name


@pytest.mark.parametrize("fmt", [tarfile.GNU_FORMAT, tarfile.PAX_FORMAT])
def test_fast_reader_matches_tarfile_and_webdataset(tmp_path: Path, fmt: int) -> None:
    url = _shard(tmp_path / "s.tar", fmt)
    fast = list(iter_samples(url, reader="fast"))
    plain = list(iter_samples(url, reader="tarfile"))
    assert len(fast) == 25 and fast == plain
    reference = [
        {k: v for k, v in s.items() if not k.startswith("__")}
        for s in wds.WebDataset(url, shardshuffle=False, empty_check=False)
    ]
    ours = [{k: v for k, v in s.items() if not k.startswith("__")} for s in fast]
    assert ours == reference
    assert [s["__key__"] for s in fast] == [
        s["__key__"] for s in wds.WebDataset(url, shardshuffle=False, empty_check=False)
    ]


@pytest.mark.parametrize("reader", ["fast", "tarfile"])
def test_bytes_read_are_counted(tmp_path: Path, reader: TarReader) -> None:
    url = _shard(tmp_path / "s.tar", tarfile.PAX_FORMAT)
    count = ByteCount()
    assert list(iter_samples(url, reader=reader, count=count)) == list(iter_samples(url))
    assert count.n == Path(url).stat().st_size  # every byte, once


def test_same_batches_through_the_stream(tmp_path: Path, make_shards) -> None:
    from ae.data.shards.spec import expand_shards
    from ae.data.shards.tar_header_count import count_samples

    urls = expand_shards(make_shards([30, 17, 25]))
    counts = [count_samples(u) for u in urls]

    def batches(reader: str) -> list[torch.Tensor]:
        stream = ShardStream(
            split="train", urls=urls, counts=counts, decoder=vector_decoder(16),
            batch_size=8, rank=0, world_size=1, num_workers=1, seed=5, epoch=2,
            shuffle_buffer=10, tar_reader=reader,
        )  # fmt: skip
        return list(stream)

    fast, plain = batches("fast"), batches("tarfile")
    assert len(fast) == 9 and all(torch.equal(a, b) for a, b in zip(fast, plain, strict=True))
