"""Samples per shard, which the plan needs: counted once per node and cached in the run folder.

Local rank 0 of each node counts every shard (its index sidecar when there is one, else one pass
over its tar headers), writes `<output_dir>/cache/shard_counts_<split>_<key>.json`, and passes a
barrier; the node's other ranks read that file after the barrier. N ranks never scan the same
files. The key hashes the URL list and, for local shards, each file's size and mtime, so changed
shards are counted again; a later run (a restart) over the same shards reads the cache. Remote
shards are keyed by URL only: delete the cache file if they change under the same URL.

Memory is O(#shards): one int per shard, plus one line per damaged shard.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

from loguru import logger

from ae.data.errors import DataError
from ae.data.index import read_index
from ae.data.spec import is_remote
from ae.data.tar_samples import scan_shard
from ae.log_lines import BAD_SHARD_SCAN, SHARD_COUNTS

# Counting is I/O bound (sidecar reads, remote fetches, header scans): a few threads overlap it.
COUNT_THREADS = 8


@dataclass
class ShardCounts:
    counts: list[int]
    indexed: int = 0  # shards counted from their index sidecar
    scanned: int = 0  # shards counted by reading their tar headers
    problems: list[str] = field(default_factory=list)  # one BAD_SHARD_SCAN line per bad shard

    @property
    def total(self) -> int:
        return sum(self.counts)


def _count_one(url: str) -> tuple[int, bool, str | None]:
    """(samples, from_index, problem line or None)."""
    index = read_index(url)
    if index is not None:
        return index.samples, True, None
    try:
        scan = scan_shard(url)
    except OSError as e:  # cannot even open it (missing, permission, command failed)
        return 0, False, BAD_SHARD_SCAN.format(url=url, reason=f"cannot open: {e}", samples=0)
    if scan.error is None:
        return scan.samples, False, None
    return (
        scan.samples,
        False,
        BAD_SHARD_SCAN.format(url=url, reason=scan.error, samples=scan.samples),
    )


def count_shards(urls: list[str]) -> ShardCounts:
    """Count every shard; damaged ones are logged at ERROR and count their whole samples.
    Remote shards are counted on a few threads (network latency overlaps); local sidecars are
    read in this thread, which measures faster than a pool for small local reads."""
    remote = [i for i, url in enumerate(urls) if is_remote(url)]
    rows: list[tuple[int, bool, str | None]] = [(0, False, None)] * len(urls)
    with ThreadPoolExecutor(max(1, min(COUNT_THREADS, len(remote)))) as pool:
        fetched = pool.map(_count_one, [urls[i] for i in remote])  # runs during the loop below
        for i, url in enumerate(urls):
            if not is_remote(url):
                rows[i] = _count_one(url)
        for i, row in zip(remote, fetched, strict=True):
            rows[i] = row
    result = ShardCounts(counts=[samples for samples, _, _ in rows])
    for _, indexed, problem in rows:
        result.indexed += indexed
        result.scanned += not indexed
        if problem is not None:
            logger.error(problem)
            result.problems.append(problem)
    return result


def counts_key(urls: list[str]) -> str:
    h = hashlib.sha256()
    for url in urls:
        h.update(url.encode())
        if not is_remote(url):
            st = os.stat(url)
            h.update(f"\t{st.st_size}\t{st.st_mtime_ns}".encode())
        h.update(b"\n")
    return h.hexdigest()[:16]


def cache_path(cache_dir: Path, split: str, urls: list[str]) -> Path:
    return cache_dir / f"shard_counts_{split}_{counts_key(urls)}.json"


def _save(path: Path, counts: ShardCounts) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    # Unique tmp name: with a shared run folder, several nodes' local rank 0 write the same file.
    tmp = path.with_name(f"{path.name}.tmp{os.getpid()}.{time.monotonic_ns()}")
    try:
        tmp.write_text(json.dumps(asdict(counts), separators=(",", ":")))
        tmp.replace(path)
    except BaseException:  # a full disk (ENOSPC) leaves no partial file behind
        tmp.unlink(missing_ok=True)
        raise


def _load(path: Path, n: int) -> ShardCounts | None:
    try:
        counts = ShardCounts(**json.loads(path.read_text()))
    except (OSError, ValueError, TypeError):
        return None
    return counts if len(counts.counts) == n else None


def shared_counts(
    split: str,
    urls: list[str],
    cache_dir: Path,
    *,
    local_zero: bool,
    barrier: Callable[[], None],
) -> ShardCounts:
    """The counts for `urls`, computed (or found in the cache) by the node's local rank 0 and
    read by its other ranks after `barrier()`. Every rank must call this."""
    path = cache_path(cache_dir, split, urls)
    t0 = time.perf_counter()
    source = f"from cache {path}"
    counts = _load(path, len(urls)) if local_zero else None
    if local_zero and counts is None:
        counts = count_shards(urls)
        _save(path, counts)
        source = f"counted in {time.perf_counter() - t0:.2f}s, cached in {path}"
    elif local_zero and counts is not None:
        for problem in counts.problems:  # still true: the key covers the files' size and mtime
            logger.error(problem)
    barrier()
    if counts is None:
        counts = _load(path, len(urls))
        if counts is None:
            raise DataError(
                f"{split}_shards: shard counts missing at {path} after local rank 0 wrote them;"
                " is --output_dir writable and the same path on every rank of a node?"
            )
    logger.info(
        SHARD_COUNTS.format(
            split=split,
            shards=len(urls),
            samples=counts.total,
            indexed=counts.indexed,
            scanned=counts.scanned,
            source=source,
        )
    )
    return counts
