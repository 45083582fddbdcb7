"""Compressed shards (gzip, bzip2, xz): read, counted, indexed, sliced, found by a folder spec;
damage in them is reported like damage in a plain tar; zstd is refused with a clear message."""

from __future__ import annotations

import bz2
import gzip
import itertools
import lzma
from pathlib import Path

import pytest

from ae.cli.shards import main as ae_shards
from ae.data.planning.counts import count_shards
from ae.data.shards.index import read_index, sample_offset
from ae.data.shards.spec import expand_shards
from ae.data.shards.tar_header_count import scan_shard
from ae.data.shards.tar_samples import iter_samples
from ae.data.shards.writer import write_shard
from ae.data.stream.stages import read_shard
from tests.support.shards import vector_samples

COMPRESS = {".tar.gz": gzip.compress, ".tgz": gzip.compress, ".tar.bz2": bz2.compress,
            ".tar.xz": lzma.compress}  # fmt: skip


def _plain(tmp_path: Path, n: int = 12) -> Path:
    path = tmp_path / "plain.tar"
    write_shard(path, vector_samples(n, 8))
    path.with_name("plain.tar.idx").unlink()
    return path


def _compressed(tmp_path: Path, suffix: str, n: int = 12) -> Path:
    out = tmp_path / f"c{suffix}"
    out.write_bytes(COMPRESS[suffix](_plain(tmp_path, n).read_bytes()))
    return out


@pytest.mark.parametrize("suffix", list(COMPRESS))
@pytest.mark.parametrize("reader", ["fast", "tarfile"])
def test_compressed_shard_reads_like_the_plain_one(tmp_path: Path, suffix: str, reader) -> None:
    plain, packed = _plain(tmp_path), _compressed(tmp_path, suffix)
    want = [(s["__key__"], s["npy"]) for s in iter_samples(str(plain))]
    got = [(s["__key__"], s["npy"]) for s in iter_samples(str(packed), 0, reader)]
    assert got == want and len(got) == 12
    scan = scan_shard(str(packed))
    assert scan.samples == 12 and scan.offsets is None and scan.error is None
    piped = scan_shard(f"pipe:cat {packed}")
    assert piped.samples == 12 and piped.error is None
    assert len(list(iter_samples(f"pipe:cat {packed}"))) == 12


def test_compressed_shard_is_indexed_by_count_and_sliced_from_the_top(tmp_path: Path) -> None:
    packed = _compressed(tmp_path, ".tar.gz")
    assert ae_shards(["index", str(packed)]) == 0
    index = read_index(str(packed), with_offsets=True)
    assert index is not None and index.samples == 12 and index.offsets is None
    assert sample_offset(str(packed), 5) is None  # no seeking into a compressed shard
    keys = [s["__key__"] for s in read_shard(str(packed), 5, 9)]
    assert keys == [f"{i:08d}" for i in range(5, 9)]
    counts = count_shards([str(packed)])
    assert counts.counts == [12] and counts.indexed == 1


def test_folder_spec_finds_compressed_shards(tmp_path: Path) -> None:
    for suffix in COMPRESS:
        _compressed(tmp_path, suffix)
    (tmp_path / "notes.txt").write_text("not a shard")
    found = [Path(u).name for u in expand_shards(str(tmp_path))]
    assert found == sorted(["c.tar.bz2", "c.tar.gz", "c.tar.xz", "c.tgz", "plain.tar"])


def test_truncated_gzip_shard_is_reported_with_its_whole_samples(tmp_path: Path) -> None:
    packed = _compressed(tmp_path, ".tar.gz", n=40)
    data = packed.read_bytes()
    packed.write_bytes(data[: len(data) // 2])
    scan = scan_shard(str(packed))
    assert 0 < scan.samples < 40 and "EOFError" in scan.error
    good = list(itertools.islice(iter_samples(str(packed)), scan.samples))
    assert len(good) == scan.samples  # the samples counted are all readable
    with pytest.raises(EOFError):
        list(iter_samples(str(packed)))


def test_zstd_shard_is_refused_with_a_clear_message(tmp_path: Path) -> None:
    path = tmp_path / "a.tar.zst"
    path.write_bytes(b"\x28\xb5\x2f\xfd" + b"\0" * 600)
    scan = scan_shard(str(path))
    assert scan.samples == 0 and "zstd-compressed shard" in scan.error
    with pytest.raises(ValueError, match="reads plain, gzip, bzip2 and xz"):
        list(iter_samples(str(path)))
