"""Counting shards for the plan: index first, walk otherwise, a share per rank, cached per user."""

from __future__ import annotations

import functools
import http.server
import json
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import ClassVar

import pytest
from loguru import logger

import ae.data.planning.counts as shard_counts
from ae.data.planning.counts import cache_path, count_shards, shared_counts
from ae.data.shards.errors import DataError
from ae.data.shards.index import read_index
from ae.data.shards.tar_header_count import scan_shard
from ae.data.shards.writer import write_shard
from ae.log_lines import COUNT_PROGRESS
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


def _ranks(world: int, run) -> list:
    """Run `run(rank, gather)` on `world` threads, each a rank; `gather` is a real exchange
    (every rank hands in its dict and gets all of them, in rank order) as an all-gather is."""
    box: list = [None] * world
    sync = threading.Barrier(world)

    def gather_for(rank: int):
        def gather(mine: dict) -> list[dict]:
            box[rank] = json.loads(json.dumps(mine))  # what crosses the wire: plain data
            sync.wait()
            out = list(box)
            sync.wait()
            return out

        return gather

    results: list = [None] * world
    errors: list = []

    def body(rank: int) -> None:
        try:
            results[rank] = run(rank, gather_for(rank))
        except Exception as e:
            errors.append(e)
            sync.abort()

    threads = [threading.Thread(target=body, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return results


def test_ranks_count_a_share_each_and_all_get_the_same_counts(tmp_path: Path, monkeypatch) -> None:
    sizes = [3, 4, 5, 6, 7, 8, 9]
    urls = _shards(tmp_path / "data", sizes)
    for url in urls:
        Path(url + ".idx").unlink()  # no sidecars: every shard is walked
    walked: list[str] = []
    real = shard_counts.scan_shard
    monkeypatch.setattr(shard_counts, "scan_shard", lambda u: walked.append(u) or real(u))
    cache = tmp_path / "cache"

    def rank(r: int, gather) -> list[int]:
        counts = shared_counts("train", urls, cache, rank=r, world_size=3, gather=gather)
        return counts.counts

    assert _ranks(3, rank) == [sizes] * 3  # every rank holds every count
    assert sorted(walked) == sorted(urls)  # each shard walked once, by one rank
    assert cache_path(cache, urls).exists()
    # a second run (a new --output_dir) counts nothing: the per-user cache has them
    assert _ranks(3, rank) == [sizes] * 3 and len(walked) == len(urls)
    write_shard(Path(urls[0]), vector_samples(6, 4))  # changed shard: new key, counted again
    Path(urls[0] + ".idx").unlink()
    again = _ranks(2, lambda r, g: shared_counts("t", urls, cache, rank=r, world_size=2, gather=g))
    assert again[0].counts == again[1].counts == [6, *sizes[1:]]


def test_ranks_that_see_different_files_stop_naming_the_split(tmp_path: Path) -> None:
    urls = _shards(tmp_path / "a", [3, 4])
    other = _shards(tmp_path / "b", [3, 5])  # the same names on another node's disk

    def rank(r: int, gather) -> None:
        shared_counts("val", urls if r == 0 else other, None, rank=r, world_size=2, gather=gather)

    with pytest.raises(DataError, match="val_shards: ranks see different shard files"):
        _ranks(2, rank)


def test_sidecars_are_written_as_a_by_product_of_counting(tmp_path: Path) -> None:
    urls = _shards(tmp_path, [5, 6])
    for url in urls:
        Path(url + ".idx").unlink()
    first = shared_counts("train", urls, None, write_sidecars=True)
    assert (first.indexed, first.scanned) == (0, 2)
    again = count_shards(urls)
    assert again.counts == [5, 6] and (again.indexed, again.scanned) == (2, 0)
    assert read_index(urls[1], with_offsets=True).offsets == scan_shard(urls[1]).offsets


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


def test_a_long_count_says_how_far_it_is(tmp_path: Path, monkeypatch) -> None:
    urls = _shards(tmp_path, [5, 6, 7])
    for url in urls:
        Path(url + ".idx").unlink()
    monkeypatch.setattr(shard_counts, "PROGRESS_AFTER_S", 0.0)  # every shard: a line
    monkeypatch.setattr(shard_counts, "PROGRESS_EVERY_S", 0.0)
    lines: list[str] = []
    sink = logger.add(lambda m: lines.append(m.record["message"]), level="INFO")
    try:
        shared_counts("train", urls, None)
    finally:
        logger.remove(sink)
    progress = [line for line in lines if line.startswith("Counting train_shards")]
    assert progress[-1].startswith("Counting train_shards: 3/3 shards of this rank's share, 18 ")
    assert COUNT_PROGRESS.parse(progress[-1])["eta"] == "0"


def test_a_remote_shard_that_failed_is_counted_again_by_the_next_run(
    http_dir, tmp_path: Path
) -> None:
    """The cache knows remote shards by URL alone: a 404 (or a server down, a cut transfer) was
    cached as `0 samples` and replayed by every later run, with its stale ERROR, so the shard
    was never trained on once it was there."""
    base, root, _ = http_dir
    write_shard(root / "a.tar", vector_samples(5, 4))
    urls, cache = [f"{base}/a.tar", f"{base}/b.tar"], tmp_path / "cache"
    first = shared_counts("train", urls, cache)
    assert first.counts == [5, 0] and "curl exit 22" in first.problems[0]
    assert not cache_path(cache, urls).exists()
    write_shard(root / "b.tar", vector_samples(7, 4))  # uploaded, or the server is back
    assert shared_counts("train", urls, cache).counts == [5, 7]
    assert cache_path(cache, urls).exists()
    # A cache written before this rule, holding a remote shard's failure, is not believed
    stale = {"counts": [5, 0], "indexed": 1, "scanned": 1, "problems": [first.problems[0]]}
    cache_path(cache, urls).write_text(json.dumps(stale))
    assert shared_counts("train", urls, cache).counts == [5, 7]


def test_a_long_count_of_remote_shards_says_how_far_it_is(http_dir, monkeypatch) -> None:
    """The progress line came after each local shard only: remote ones (fetched on threads)
    were counted in silence, however long they took."""
    base, root, _ = http_dir
    for name in ("a.tar", "b.tar"):
        write_shard(root / name, vector_samples(6, 4))
        (root / f"{name}.idx").unlink()
    monkeypatch.setattr(shard_counts, "PROGRESS_AFTER_S", 0.0)
    monkeypatch.setattr(shard_counts, "PROGRESS_EVERY_S", 0.0)
    lines: list[str] = []
    sink = logger.add(lambda m: lines.append(m.record["message"]), level="INFO")
    try:
        shared_counts("train", [f"{base}/a.tar", f"{base}/b.tar"], None)
    finally:
        logger.remove(sink)
    progress = [line for line in lines if line.startswith("Counting train_shards")]
    assert progress and progress[-1].startswith("Counting train_shards: 2/2 shards of this rank")
