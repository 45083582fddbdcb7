"""Samples per shard, which the plan needs: counted by every rank at once, cached per user.

Each rank counts its share of the shards (shard i belongs to rank i % world_size: its index
sidecar when there is one, else one header walk, `ae.data.shards.tar_header_count`), the ranks
exchange what they found in one all-gather, and every rank assembles the same list. The counts are
then cached in a per-user count cache (`--count_cache`, default `~/.cache/ae/shard-counts/`, which
`$AE_CACHE_DIR` moves), so a later run over the same shards, in any `--output_dir`, counts
nothing. The cache key hashes the URL list and, for local shards, each file's size and mtime:
changed shards are counted again. Remote shards are keyed by URL only: delete the cache file if
they change under the same URL. Counts in which a remote shard failed (maybe its server's
failure) are never cached, nor believed from an older cache.

With `--write_index=auto`, a rank that walks a local shard without a sidecar writes one next to
it when the folder is writable, so the next count of that shard is one small read.

Memory is O(#shards): one int per shard, plus one line per damaged shard.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from loguru import logger

from ae import atomic_files
from ae.data.shards.errors import DataError
from ae.data.shards.index import read_index, write_index
from ae.data.shards.spec import is_remote
from ae.data.shards.tar_header_count import ShardScan, scan_shard
from ae.log_lines import BAD_SHARD_SCAN, COUNT_PROGRESS, SHARD_COUNTS, main_log

# Counting remote shards is I/O bound (sidecar reads, fetches): a few threads overlap it.
COUNT_THREADS = 8
PROGRESS_AFTER_S = 3.0  # a count that takes longer than this says how far it is ...
PROGRESS_EVERY_S = 5.0  # ... this often

# What a rank sends the others: its view of the files, and its counts.
Gather = Callable[[dict[str, Any]], list[dict[str, Any]]]


@dataclass
class ShardCounts:
    counts: list[int]
    indexed: int = 0  # shards counted from their index sidecar
    scanned: int = 0  # shards counted by reading their tar headers
    problems: list[str] = field(default_factory=list)  # one BAD_SHARD_SCAN line per bad shard

    @property
    def total(self) -> int:
        return sum(self.counts)


def count_cache_dir(flag: str) -> Path | None:
    """`--count_cache`: auto = `$AE_CACHE_DIR/shard-counts` (default `~/.cache/ae`), off =
    none, else that folder."""
    if flag == "off":
        return None
    if flag == "auto":
        root = os.environ.get("AE_CACHE_DIR", Path.home() / ".cache" / "ae")
        return Path(root) / "shard-counts"
    return Path(flag).expanduser()


def _writable_dir(url: str) -> bool:
    return not is_remote(url) and os.access(os.path.dirname(os.path.abspath(url)), os.W_OK)


def _count_one(url: str, write_sidecar: bool) -> tuple[int, bool, str | None]:
    """(samples, from_index, problem line or None)."""
    index = read_index(url)
    if index is not None:
        return index.samples, True, None
    try:
        scan = scan_shard(url)
    except OSError as e:  # cannot even open it (missing, permission, command failed)
        return 0, False, BAD_SHARD_SCAN.format(url=url, reason=f"cannot open: {e}", samples=0)
    if scan.error is None:
        if write_sidecar and _writable_dir(url):
            _write_sidecar(url, scan)
        return scan.samples, False, None
    return (
        scan.samples,
        False,
        BAD_SHARD_SCAN.format(url=url, reason=scan.error, samples=scan.samples),
    )


def _write_sidecar(url: str, scan: ShardScan) -> None:
    try:
        write_index(Path(url), scan.samples, scan.offsets)
    except OSError as e:  # a full disk or a folder that turned read-only: counting goes on
        logger.warning(f"Could not write the index sidecar of {url}: {e}")


def count_shards(
    urls: list[str],
    write_sidecars: bool = False,
    progress: Callable[[int, int], None] | None = None,
) -> ShardCounts:
    """Count every shard; damaged ones are logged at ERROR and count their whole samples.
    Remote shards are counted on a few threads (network latency overlaps); local ones in this
    thread (the header walk is bound by this core). `progress(done, samples)` after each shard,
    and every second while remote ones are still being fetched."""
    remote = [i for i, url in enumerate(urls) if is_remote(url)]
    rows: list[tuple[int, bool, str | None]] = [(0, False, None)] * len(urls)
    done = samples = 0

    def counted(i: int, row: tuple[int, bool, str | None]) -> None:
        nonlocal done, samples
        rows[i] = row
        done, samples = done + 1, samples + row[0]

    with ThreadPoolExecutor(max(1, min(COUNT_THREADS, len(remote)))) as pool:
        fetching: dict[Future[tuple[int, bool, str | None]], int] = {
            pool.submit(_count_one, urls[i], False): i for i in remote
        }
        for i, url in enumerate(urls):
            if not is_remote(url):
                counted(i, _count_one(url, write_sidecars))
                if progress is not None:
                    progress(done, samples)
        # As they come, so that a long count of remote shards says how far it is too
        pending = set(fetching)
        while pending:
            finished, pending = wait(pending, timeout=1.0, return_when=FIRST_COMPLETED)
            for future in finished:
                counted(fetching[future], future.result())
            if progress is not None:
                progress(done, samples)
    result = ShardCounts(counts=[samples for samples, _, _ in rows])
    for _, indexed, problem in rows:
        result.indexed += indexed
        result.scanned += not indexed
        if problem is not None:
            logger.error(problem)
            result.problems.append(problem)
    return result


def _file_sizes(urls: list[str]) -> tuple[str, str]:
    """(cache key: URLs, sizes and mtimes; files digest: URLs and sizes, which every node must
    see alike). Stats each local shard once."""
    key, files = hashlib.sha256(), hashlib.sha256()
    for url in urls:
        line = url.encode()
        stamp = b""
        if not is_remote(url):
            st = os.stat(url)
            line += f"\t{st.st_size}".encode()
            stamp = f"\t{st.st_mtime_ns}".encode()
        key.update(line + stamp + b"\n")
        files.update(line + b"\n")
    return key.hexdigest()[:24], files.hexdigest()[:24]


def cache_path(cache_dir: Path, urls: list[str]) -> Path:
    return cache_dir / f"counts-{_file_sizes(urls)[0]}.json"


def _save(path: Path, counts: ShardCounts) -> None:
    # Ranks of several nodes may write the same file of a shared cache: each through its own
    # temporary file; not fsynced, a lost cache costs a count.
    data = json.dumps(asdict(counts), separators=(",", ":")).encode()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_files.write(path, data, durable=False)
    except OSError as e:  # an unwritable cache costs the next run a count, not this one
        logger.warning(f"Could not write the shard count cache {path}: {e}")


def _load(path: Path | None, n: int) -> ShardCounts | None:
    if path is None:
        return None
    try:
        counts = ShardCounts(**json.loads(path.read_text()))
    except (OSError, ValueError, TypeError):
        return None
    return counts if len(counts.counts) == n else None


class _Progress:
    """`Counting ...` lines on rank 0's console while counting lasts more than a few seconds."""

    def __init__(self, split: str, shards: int, rank: int) -> None:
        self.split, self.shards, self.rank = split, shards, rank
        self.t0 = self.last = time.monotonic()

    def __call__(self, done: int, samples: int) -> None:
        now = time.monotonic()
        if now - self.t0 < PROGRESS_AFTER_S or now - self.last < PROGRESS_EVERY_S or not done:
            return
        self.last = now
        elapsed = now - self.t0
        log = main_log if self.rank == 0 else logger
        log.info(
            COUNT_PROGRESS.format(
                split=self.split,
                done=done,
                shards=self.shards,
                samples=samples,
                rate=round(samples / elapsed),
                eta=round(elapsed * (self.shards - done) / done),
            )
        )


def shared_counts(
    split: str,
    urls: list[str],
    cache_dir: Path | None,
    *,
    rank: int = 0,
    world_size: int = 1,
    gather: Gather = lambda mine: [mine],
    write_sidecars: bool = False,
) -> ShardCounts:
    """The counts of `urls`, the same on every rank: from the count cache, or counted by all
    ranks (rank r counts shards r, r + world_size, ...) and exchanged with one `gather` (an
    all-gather of one small dict per rank). Every rank must call this. Raises DataError when the
    ranks do not see the same files or disagree on a count."""
    t0 = time.perf_counter()
    key, files = _file_sizes(urls)
    path = None if cache_dir is None else cache_dir / f"counts-{key}.json"
    cached = _load(path, len(urls))
    if cached is not None and _remote_problems(cached):
        cached = None  # a remote shard unreadable then (server down, cut transfer): ask again
    mine: dict[str, Any] = {"files": files, "full": None, "share": None}
    if cached is not None:
        mine["full"] = asdict(cached)
        for problem in cached.problems:  # still true: the key covers the files' size and mtime
            logger.error(problem)
    else:
        share = urls[rank::world_size]
        progress = _Progress(split, len(share), rank)
        mine["share"] = asdict(count_shards(share, write_sidecars, progress))
    parts = gather(mine)
    counts = _assemble(split, parts, len(urls))
    if cached is not None and all(p["full"] is not None for p in parts):
        source = f"from cache {path}"
    else:
        took = f"counted in {time.perf_counter() - t0:.2f}s on {world_size} rank(s)"
        source = f"{took}, not cached (--count_cache=off)" if path is None else took
        if path is not None and cached is None and (failed := _remote_problems(counts)):
            # Keyed by URL alone, a remote shard's failure would be replayed by every later run,
            # the shard then never trained on though its server answers again.
            retry = f"{failed} remote shard(s) unreadable, the next run counts again"
            source = f"{took}, not cached: {retry}"
        elif path is not None and cached is None:
            _save(path, counts)
            source = f"{took}, cached in {path}"
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


def _remote_problems(counts: ShardCounts) -> int:
    """How many of the damaged shards of `counts` are remote. The cache key knows a remote
    shard by its URL alone, so its failure may be the server's, not the shard's."""
    urls = [(BAD_SHARD_SCAN.parse(problem) or {}).get("url", "") for problem in counts.problems]
    return sum(is_remote(url) for url in urls)


def _assemble(split: str, parts: list[dict[str, Any]], n: int) -> ShardCounts:
    """Every rank's share (or a cached whole) -> the counts; the same on every rank."""
    if len({p["files"] for p in parts}) > 1:
        raise DataError(
            f"{split}_shards: ranks see different shard files (names or sizes differ between "
            "nodes); every node must see the same shards"
        )
    world = len(parts)
    full = next((ShardCounts(**p["full"]) for p in parts if p["full"] is not None), None)
    out = ShardCounts(counts=[0] * n)
    for r, p in enumerate(parts):
        if p["share"] is not None:
            share = ShardCounts(**p["share"])
            out.counts[r::world] = share.counts
            out.indexed += share.indexed
            out.scanned += share.scanned
            out.problems += share.problems
        elif full is not None:
            out.counts[r::world] = full.counts[r::world]
    if full is not None and all(p["share"] is None for p in parts):
        out.indexed, out.scanned, out.problems = full.indexed, full.scanned, full.problems
    for p in parts:
        if p["full"] is not None and p["full"]["counts"] != out.counts:
            raise DataError(
                f"{split}_shards: ranks counted different samples per shard (a stale count "
                "cache on some node? do all nodes see the same files?); see the `Shard counts` "
                "line in each rank's log"
            )
    return out
