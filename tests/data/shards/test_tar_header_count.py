"""The block-wise header walk counts what Python's `tarfile` counts, on every tar flavour."""

from __future__ import annotations

import gzip
import io
import itertools
import random
import tarfile
from pathlib import Path

import pytest
import webdataset as wds

from ae.data.shards import tar_header_count
from ae.data.shards.tar_header_count import scan_shard
from ae.data.shards.tar_samples import iter_samples, split_name

FORMATS = {"gnu": tarfile.GNU_FORMAT, "pax": tarfile.PAX_FORMAT, "ustar": tarfile.USTAR_FORMAT}


def tarfile_samples(path: Path) -> list[tuple[str, int]]:
    """The reference: (key, offset of its first member's header) per sample, by `tarfile`."""
    out: list[tuple[str, int]] = []
    with tarfile.open(path, "r:*") as tar:
        for info in tar:
            parts = split_name(info.name) if info.isfile() else None
            if parts is not None and (not out or out[-1][0] != parts[0]):
                out.append((parts[0], info.offset))
    return out


def _add(tar: tarfile.TarFile, name: str, data: bytes, kind: bytes = tarfile.REGTYPE) -> None:
    info = tarfile.TarInfo(name)
    info.type = kind
    info.size = len(data) if kind == tarfile.REGTYPE else 0
    tar.addfile(info, io.BytesIO(data) if kind == tarfile.REGTYPE else None)


def mixed_shard(path: Path, fmt: int, samples: int = 300, seed: int = 0) -> None:
    """Short, long (> 100 bytes: GNU `L`, PAX `path`, ustar prefix) and non-ASCII names, several
    fields per sample, directories, symlinks, `__meta__` members, members bigger than a window."""
    rng = random.Random(seed)
    with tarfile.open(path, "w", format=fmt, encoding="utf-8") as tar:
        for i in range(samples):
            folder = "d/" * rng.choice([0, 0, 0, 40]) + rng.choice(["", "sub/", "é/"])
            key = f"{folder}{i:06d}" + ("ü" if fmt != tarfile.USTAR_FORMAT and i % 7 == 0 else "")
            if i % 50 == 3:
                _add(tar, f"{folder}dir{i}", b"", tarfile.DIRTYPE)
                _add(tar, f"{key}.link", b"", tarfile.SYMTYPE)
            if i % 61 == 5:
                _add(tar, f"__meta{i}__", b"x")
            big = i == 17
            for ext in rng.sample(["npy", "cls", "seg.png", "json"], rng.randint(1, 3)):
                size = tar_header_count.WINDOW + 1000 if big else rng.randint(0, 3000)
                _add(tar, f"{key}.{ext}", rng.randbytes(size))
                big = False


@pytest.mark.parametrize("flavour", FORMATS)
def test_counts_and_offsets_equal_tarfile(tmp_path: Path, flavour: str) -> None:
    path = tmp_path / f"{flavour}.tar"
    mixed_shard(path, FORMATS[flavour])
    reference = tarfile_samples(path)
    scan = scan_shard(str(path))
    assert scan.error is None and scan.samples == len(reference) > 250
    # An offset is where the sample's header chain starts: reading from there sees its key.
    assert scan.offsets is not None and len(scan.offsets) == len(reference)
    for k in range(0, len(reference), 37):
        first = next(iter_samples(str(path), scan.offsets[k]))
        assert first["__key__"] == reference[k][0]
        assert scan.offsets[k] <= reference[k][1]  # tarfile names the member's own header
    gz = tmp_path / f"{flavour}.tar.gz"
    gz.write_bytes(gzip.compress(path.read_bytes(), compresslevel=1))
    streamed = scan_shard(str(gz))
    assert (streamed.samples, streamed.offsets, streamed.error) == (len(reference), None, None)


def test_webdataset_tarwriter_shard_spanning_windows(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(tar_header_count, "WINDOW", 64 * 1024)  # many windows, samples cut by them
    path = tmp_path / "wds.tar"
    with wds.TarWriter(str(path)) as sink:
        for i in range(500):
            sink.write({"__key__": f"k{i:05d}", "npy": b"x" * (i % 700), "cls": str(i)})
    scan = scan_shard(str(path))
    assert scan.samples == len(tarfile_samples(path)) == 500 and scan.error is None
    assert [s["__key__"] for s in iter_samples(str(path), scan.offsets[321])][:2] == [
        "k00321",
        "k00322",
    ]


@pytest.mark.parametrize("flavour", ["gnu", "pax"])
def test_truncated_shard_counts_the_whole_samples_before_the_cut(
    tmp_path: Path, flavour: str
) -> None:
    path = tmp_path / "cut.tar"
    mixed_shard(path, FORMATS[flavour], samples=60, seed=1)
    whole = scan_shard(str(path))
    data = path.read_bytes()
    for cut in (whole.offsets[40] + 10, whole.offsets[40] + 700, whole.offsets[50] - 512):
        path.write_bytes(data[:cut])
        scan = scan_shard(str(path))
        # Sample i is whole once sample i + 1 begins before the cut; it is known to be whole
        # once that sample's header is read (before then it might miss members).
        known = sum(1 for o in whole.offsets[2:] if o <= cut)
        begun = sum(1 for o in whole.offsets[1:] if o < cut)
        assert known <= scan.samples <= begun and "truncated" in scan.error
        assert scan.offsets == whole.offsets[: scan.samples]
        read = list(itertools.islice(iter_samples(str(path)), scan.samples))
        assert len(read) == scan.samples  # the samples counted are all readable


def test_bad_checksum_ends_the_count_there(tmp_path: Path) -> None:
    path = tmp_path / "bad.tar"
    mixed_shard(path, tarfile.GNU_FORMAT, samples=30, seed=2)
    whole = scan_shard(str(path))
    data = bytearray(path.read_bytes())
    data[whole.offsets[20] + 5] ^= 0xFF  # a name byte of sample 20's first header
    path.write_bytes(bytes(data))
    scan = scan_shard(str(path))
    assert scan.samples == 19 and "checksum" in scan.error
