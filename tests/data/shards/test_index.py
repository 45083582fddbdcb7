"""Index sidecars and the tar scan: counts and offsets without reading shards, damage reported."""

from __future__ import annotations

import itertools
from pathlib import Path

from ae.data.shards.index import index_url, read_index, sample_offset, write_index
from ae.data.shards.tar_header_count import scan_shard
from ae.data.shards.tar_samples import iter_samples
from ae.data.shards.writer import write_shard
from tests.support.shards import vector_samples


def _shard(tmp_path: Path, n: int = 10, name: str = "a.tar") -> Path:
    path = tmp_path / name
    write_shard(path, vector_samples(n, 8))
    return path


def _truncate(path: Path, keep: int) -> None:
    path.write_bytes(path.read_bytes()[:keep])


def test_writer_index_matches_a_scan_and_offsets_seek_to_samples(tmp_path: Path) -> None:
    path = _shard(tmp_path)
    index = read_index(str(path), with_offsets=True)
    scan = scan_shard(str(path))
    assert index is not None and index.samples == scan.samples == 10 and scan.error is None
    assert index.offsets == scan.offsets and index.bytes == path.stat().st_size
    offset = sample_offset(str(path), 7)
    assert offset == index.offsets[7] > 0
    keys = [s["__key__"] for s in iter_samples(str(path), offset)]
    assert keys == ["00000007", "00000008", "00000009"]


def test_index_url_rules() -> None:
    assert index_url("/d/a-000001.tar") == "/d/a-000001.tar.idx"
    assert index_url("https://h/d/a.tar?sig=1") == "https://h/d/a.tar.idx?sig=1"
    assert index_url("pipe:aws s3 cp s3://b/a.tar -") == (
        "pipe:aws s3 cp s3://b/a.tar.idx - 2>/dev/null"
    )
    assert index_url("pipe:cat a.tar b.tar") is None  # ambiguous: no index
    # compressed shards have sidecars too (the count; no offsets)
    assert index_url("pipe:cat a.tar.gz") == "pipe:cat a.tar.gz.idx 2>/dev/null"
    assert index_url("pipe:curl -s h/a.tgz") == "pipe:curl -s h/a.tgz.idx 2>/dev/null"
    assert index_url("pipe:cat a.tar.gzip") is None


def test_stale_or_malformed_index_is_ignored(tmp_path: Path) -> None:
    path = _shard(tmp_path)
    write_shard(path.with_name("b.tar"), vector_samples(3, 8))
    path.write_bytes(path.with_name("b.tar").read_bytes())  # replaced, old index kept
    assert read_index(str(path)) is None
    Path(index_url(str(path))).write_text("not json\n")
    assert read_index(str(path)) is None
    write_index(path, 3, None)  # an index without offsets still counts; no seeking then
    assert read_index(str(path)).samples == 3 and sample_offset(str(path), 2) is None


def test_truncated_shard_scan_counts_whole_samples(tmp_path: Path) -> None:
    path = _shard(tmp_path)
    offsets = scan_shard(str(path)).offsets
    _truncate(path, offsets[6] + 700)  # inside sample 6's body
    scan = scan_shard(str(path))
    assert scan.samples == 6 and scan.offsets == offsets[:6]
    assert "unexpected end of data" in scan.error
    # a reader asking for those 6 never touches the damaged bytes
    keys = [s["__key__"] for s in itertools.islice(iter_samples(str(path)), 6)]
    assert keys == [f"{i:08d}" for i in range(6)]


def test_shard_cut_inside_a_header_is_reported(tmp_path: Path) -> None:
    path = _shard(tmp_path)
    _truncate(path, scan_shard(str(path)).offsets[4] + 100)
    scan = scan_shard(str(path))
    # tarfile itself ends quietly there; the missing end marker gives the cut away. The sample
    # before the cut might have had more members, so it is not counted either.
    assert scan.samples == 3 and "truncated" in scan.error


def test_non_tar_is_unreadable(tmp_path: Path) -> None:
    path = tmp_path / "junk.tar"
    path.write_bytes(b"this is not a tar file" * 100)
    scan = scan_shard(str(path))
    assert scan.samples == 0 and "not a readable tar" in scan.error


def test_pipe_shard_reads_and_scans(tmp_path: Path) -> None:
    path = _shard(tmp_path)
    url = f"pipe:cat {path}"
    assert scan_shard(url).samples == 10 and scan_shard(url).offsets is None
    assert read_index(url).samples == 10  # through `pipe:cat <path>.idx`
    assert sample_offset(url, 3) is None  # pipes are read from the top
    assert len(list(iter_samples(url))) == 10
