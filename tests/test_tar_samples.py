"""The fast tar reader gives the same samples, in the same order, as Python's tarfile and as
WebDataset's own pipeline."""

from __future__ import annotations

import io
import tarfile
from pathlib import Path

import numpy as np
import pytest
import torch
import webdataset as wds

from ae.dataset import ShardStream
from ae.decode import InputSpec
from ae.tar_samples import iter_samples, split_name
from tests.conftest import npy_bytes


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


def test_split_name_follows_webdataset() -> None:
    assert split_name("a/b/000123.seg.png") == ("a/b/000123", "seg.png")
    assert split_name("000123.npy") == ("000123", "npy")
    assert split_name("noext") is None and split_name("dir.x/.hidden") is None


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


def test_same_batches_through_the_stream(tmp_path: Path, make_shards) -> None:
    from ae.shard_spec import expand_shards
    from ae.tar_samples import count_samples

    urls = expand_shards(make_shards([30, 17, 25]))
    counts = [count_samples(u) for u in urls]

    def batches(reader: str) -> list[torch.Tensor]:
        stream = ShardStream(
            split="train", urls=urls, counts=counts, spec=InputSpec("vector", (16,)),
            batch_size=8, rank=0, world_size=1, num_workers=1, seed=5, epoch=2,
            shuffle_buffer=10, tar_reader=reader,
        )  # fmt: skip
        return list(stream)

    fast, plain = batches("fast"), batches("tarfile")
    assert len(fast) == 9 and all(torch.equal(a, b) for a, b in zip(fast, plain, strict=True))
