"""Counting shards for the plan: index first, scan otherwise, once per node, cached."""

from __future__ import annotations

import functools
import http.server
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import ClassVar

import pytest

import ae.data.counts as shard_counts
from ae.data.counts import cache_path, count_shards, shared_counts
from ae.data.errors import DataError
from ae.data.writer import write_shard
from tests.support.shards import vector_samples


def _shards(tmp_path: Path, sizes: list[int]) -> list[str]:
    urls = []
    for i, n in enumerate(sizes):
        path = tmp_path / f"s-{i:06d}.tar"
        write_shard(path, vector_samples(n, 4, start=100 * i))
        urls.append(str(path))
    return urls


def test_index_first_scan_otherwise_damage_counted_and_logged(tmp_path: Path, caplog) -> None:
    urls = _shards(tmp_path, [5, 7, 9])
    Path(urls[1] + ".idx").unlink()
    data = Path(urls[2]).read_bytes()
    Path(urls[2]).write_bytes(data[: 4 * 1024 + 600])  # cut in sample 4: its index is stale
    counts = count_shards(urls)
    assert counts.counts == [5, 7, 4]
    assert (counts.indexed, counts.scanned) == (1, 2)
    assert len(counts.problems) == 1 and urls[2] in counts.problems[0]
    assert "Bad shard" in counts.problems[0] and "counted 4 whole samples" in counts.problems[0]


def test_local_rank_zero_counts_once_others_read_the_cache(tmp_path: Path, monkeypatch) -> None:
    urls = _shards(tmp_path, [3, 4])
    calls: list[str] = []
    real = shard_counts.count_shards
    monkeypatch.setattr(shard_counts, "count_shards", lambda u: calls.append("count") or real(u))
    barrier = functools.partial(calls.append, "barrier")
    cache = tmp_path / "run" / "cache"

    zero = shared_counts("train", urls, cache, local_zero=True, barrier=barrier)
    other = shared_counts("train", urls, cache, local_zero=False, barrier=barrier)
    assert calls == ["count", "barrier", "barrier"]  # the non-zero rank never counts
    assert zero.counts == other.counts == [3, 4]
    assert cache_path(cache, "train", urls).exists()

    shared_counts("train", urls, cache, local_zero=True, barrier=lambda: None)  # a restart
    assert calls.count("count") == 1
    write_shard(Path(urls[0]), vector_samples(6, 4))  # changed shard: new key, counted again
    again = shared_counts("train", urls, cache, local_zero=True, barrier=lambda: None)
    assert again.counts == [6, 4] and calls.count("count") == 2


def test_missing_cache_after_barrier_is_a_clear_error(tmp_path: Path) -> None:
    urls = _shards(tmp_path, [3])
    with pytest.raises(DataError, match="train_shards: shard counts missing"):
        shared_counts("train", urls, tmp_path / "c", local_zero=False, barrier=lambda: None)


class _Recorder(http.server.SimpleHTTPRequestHandler):
    requests: ClassVar[list[str]]  # set per server by the fixture

    def do_GET(self) -> None:
        self.requests.append(self.path)
        super().do_GET()

    def log_message(self, *args: object) -> None:  # keep test output clean
        pass


@pytest.fixture
def http_dir(tmp_path: Path) -> Iterator[tuple[str, Path, list[str]]]:
    """(base URL, served folder, request paths) of a local HTTP server."""
    root = tmp_path / "www"
    root.mkdir()
    requests: list[str] = []
    handler = type("H", (_Recorder,), {"requests": requests})
    server = http.server.ThreadingHTTPServer(
        ("127.0.0.1", 0), functools.partial(handler, directory=str(root))
    )
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}", root, requests
    server.shutdown()
    server.server_close()


def test_http_shards_counted_from_index_without_download(http_dir) -> None:
    base, root, requests = http_dir
    for name, n in (("a.tar", 5), ("b.tar", 8)):
        write_shard(root / name, vector_samples(n, 4))
    (root / "b.tar.idx").unlink()  # b has no index: streamed once to count it
    counts = count_shards([f"{base}/a.tar", f"{base}/b.tar"])
    assert counts.counts == [5, 8] and (counts.indexed, counts.scanned) == (1, 1)
    assert "/a.tar" not in requests and "/a.tar.idx" in requests  # a was never downloaded
    assert "/b.tar" in requests
