"""`ae-shards bench SPEC`: will these shards keep a GPU fed? The training input pipeline, timed.

It runs what a rank of a run runs (`ShardDataModule`: the same counting, plan, stream, decode
and preprocessing, and the train DataLoader with its workers, pinning and prefetching), as rank
0 of 1, and takes batches as fast as they come for `--seconds`. Before that it reads the same
shard files once, raw, in big chunks: the storage limit (and, as a training run reads its data
more than once, it leaves them in the page cache as a later epoch finds them).

Reported: samples/s delivered to the main process (after the first batch), MB/s of shard bytes
that stands for (samples/s x the shards' bytes per sample), the time to the first batch (worker
start, opening shards, the first shuffle), the raw read rate, and which path the rank's first
slot took (`columnar`: whole-batch gathers; `general`: sample by sample;
`ae.data.stream.fixed_layout_batches`).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

from webdataset.gopen import gopen

from ae.config import DataConfig
from ae.data.datamodule import ShardDataModule
from ae.data.shards.pipes import plain_errors
from ae.data.shards.spec import expand_shards, is_remote
from ae.data.stream.fixed_layout_batches import columnar_slot

READ_CHUNK = 8 << 20


@dataclass(frozen=True)
class BenchResult:
    samples_per_s: float
    shard_mb_per_s: float | None  # None when the shards' sizes are unknown (remote)
    first_batch_s: float
    read_limit_mb_per_s: float
    path: str  # columnar / general
    shards: int
    samples: int  # in the shards
    batch_size: int
    num_workers: int
    seconds: float  # timed, after the first batch
    batches: int  # timed
    bad_reads: int = 0  # bad samples read (each again every epoch), replaced by good ones


def read_limit(urls: list[str], seconds: float) -> float:
    """MB/s of reading the shard files raw (8 MB reads), all of them or for `seconds`."""
    done, started = 0, time.perf_counter()
    for url in urls:
        with plain_errors(gopen(url, "rb")) as f:  # a failed curl or pipe: said plainly
            while chunk := f.read(READ_CHUNK):
                done += len(chunk)
        if time.perf_counter() - started > seconds:
            break
    return done / max(time.perf_counter() - started, 1e-9) / 1e6


def run_bench(spec: str, cfg: DataConfig, seconds: float) -> BenchResult:
    """Time the train loader of a one-rank run of `cfg` over `spec` for `seconds`."""
    urls = expand_shards(spec, "spec")
    limit = read_limit(urls, seconds)
    # Counts come from the per-user cache (--count_cache), as in a run of these shards.
    dm = ShardDataModule(cfg, urls, urls, seed=0)
    dm.setup("fit")
    stream = dm.train_set
    assert stream is not None
    first_slot = stream.plan().slot_slices(0, 0)
    columnar = cfg.tar_reader == "fast" and (
        columnar_slot(urls, stream.counts, first_slot, stream.decoder) is not None
    )
    epoch, batches, samples = 0, 0, 0
    started = time.perf_counter()
    loader = dm.train_dataloader()  # once, as Lightning does: its workers persist
    first = None
    now = started
    while first is None or now - first < seconds:
        for batch in loader:
            now = time.perf_counter()
            if first is None:
                first = now  # the first batch is startup: not counted
            else:
                batches, samples = batches + 1, samples + len(batch)
            if now - first >= seconds:
                break
        else:
            epoch += 1
            dm.set_epoch(epoch)
    timed = max(now - first, 1e-9)
    total = stream.plan().total_samples
    size = None if any(is_remote(u) for u in urls) else sum(os.path.getsize(u) for u in urls)
    rate = samples / timed
    return BenchResult(
        samples_per_s=rate,
        shard_mb_per_s=None if size is None else rate * size / total / 1e6,
        first_batch_s=first - started,
        read_limit_mb_per_s=limit,
        path="columnar" if columnar else "general",
        shards=len(urls),
        samples=total,
        batch_size=cfg.batch_size,
        num_workers=cfg.num_workers,
        seconds=timed,
        batches=batches,
        bad_reads=stream.errors.totals()[0],
    )


def summary(r: BenchResult) -> list[str]:
    """The console lines of a result."""
    mb = "" if r.shard_mb_per_s is None else f" ({r.shard_mb_per_s:,.1f} MB/s of shard bytes)"
    return [
        f"{r.shards} shards, {r.samples:,} samples, batch {r.batch_size}, {r.num_workers} "
        f"workers: {r.path} path",
        f"{r.samples_per_s:,.0f} samples/s{mb} over {r.seconds:.1f} s ({r.batches} batches), "
        f"first batch after {r.first_batch_s:.2f} s",
        f"raw read of the same files: {r.read_limit_mb_per_s:,.1f} MB/s (the storage limit)",
    ] + (
        [
            f"{r.bad_reads:,} reads of bad samples (named above), replaced by good ones "
            "as a run replaces them; ae-shards inspect SPEC lists them"
        ]
        if r.bad_reads
        else []
    )
