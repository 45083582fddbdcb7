"""Input pipeline throughput, 1 rank, 0/1/2 workers: ae vs plain webdataset vs the parse ceiling.

- ae: `ShardStream` (the trainer's dataset) through a DataLoader, whole batches to the main
  process, exactly as training gets them (shuffle buffer on).
- webdataset: `WebDataset(urls).decode().to_tuple(field).batched(B)` through a DataLoader.
- ceiling: read each shard's bytes, cut members at their 512-byte headers, `np.frombuffer` the
  `.npy` payload past its header (PNG: Pillow decode); no grouping, batching or shuffling. With
  workers, each worker parses its share of the shards and returns only a count.

Usage: python -m bench.input_pipeline [--quick]   (writes bench/results/input_pipeline.json)
"""

from __future__ import annotations

import argparse
import io
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch
import webdataset as wds
from PIL import Image
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from ae.dataset import ShardStream
from ae.decode import InputSpec
from ae.shard_counts import count_shards
from bench.common import synthetic_shards, write_record

BATCH = 256


def _ceiling_parse(url: str, kind: str) -> int:
    data = Path(url).read_bytes()
    pos = n = 0
    while pos + 512 <= len(data) and data[pos] != 0:
        size = int(data[pos + 124 : pos + 136].rstrip(b" \0") or b"0", 8)
        body = data[pos + 512 : pos + 512 + size]
        if kind == "npy":
            hlen = int.from_bytes(body[8:10], "little")
            np.frombuffer(body, dtype=np.float32, offset=10 + hlen)
        else:
            np.asarray(Image.open(io.BytesIO(body)))
        n += 1
        pos += 512 + (size + 511) // 512 * 512
    return n


class _Ceiling(IterableDataset):
    def __init__(self, urls: list[str], kind: str) -> None:
        self.urls, self.kind = urls, kind

    def __iter__(self) -> Iterator[int]:
        info = get_worker_info()
        w, k = (0, 1) if info is None else (info.id, info.num_workers)
        for url in self.urls[w::k]:
            yield _ceiling_parse(url, self.kind)


def _ours(urls: list[str], kind: str, workers: int) -> DataLoader:
    spec = InputSpec("vector", (64,)) if kind == "npy" else InputSpec("image", (3, 32, 32))
    stream = ShardStream(
        split="bench",
        urls=urls,
        counts=count_shards(urls).counts,
        spec=spec,
        batch_size=BATCH,
        rank=0,
        world_size=1,
        num_workers=workers,
    )
    prefetch = 4 if workers else None
    return DataLoader(stream, batch_size=None, num_workers=workers, prefetch_factor=prefetch)


def _webdataset(urls: list[str], kind: str, workers: int) -> DataLoader:
    ds = wds.WebDataset(
        urls, shardshuffle=False, workersplitter=wds.split_by_worker, empty_check=False
    )
    ds = ds.decode(*(["rgb"] if kind == "png" else [])).to_tuple(kind).batched(BATCH)
    return DataLoader(ds, batch_size=None, num_workers=workers)


def _ceiling(urls: list[str], kind: str, workers: int) -> DataLoader:
    return DataLoader(_Ceiling(urls, kind), batch_size=None, num_workers=workers)


def _count(loader: DataLoader) -> int:
    n = 0
    for item in loader:
        if isinstance(item, int) or (isinstance(item, torch.Tensor) and item.ndim == 0):
            n += int(item)  # the ceiling's per-shard counts
        elif isinstance(item, (list, tuple)):
            n += len(item[0])
        else:
            n += len(item)
    return n


def _rate(loader: DataLoader, expect: int) -> float:
    t0 = time.perf_counter()
    n = _count(loader)
    dt = time.perf_counter() - t0
    assert n >= expect * 0.95, (n, expect)  # a pipeline that skips data is not faster
    return n / dt


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="smaller data, for a smoke run")
    ap.add_argument("--data", default="/tmp/ae-bench-data")
    args = ap.parse_args()
    sizes = {"npy": (8, 6000 if args.quick else 25000), "png": (8, 1000 if args.quick else 4000)}
    rows = []
    for kind, (shards, per_shard) in sizes.items():
        urls = synthetic_shards(Path(args.data), kind, shards, per_shard)
        total = shards * per_shard
        for workers in (0, 1, 2):
            r = {"kind": kind, "workers": workers}
            for name, make in (("ae", _ours), ("webdataset", _webdataset), ("ceiling", _ceiling)):
                r[name] = _rate(make(urls, kind, workers), total)
            r["ae_vs_webdataset"] = r["ae"] / r["webdataset"]
            r["ae_vs_ceiling"] = r["ae"] / r["ceiling"]
            rows.append(r)
            print(
                f"{kind} workers={workers}: ae {r['ae']:,.0f}/s, "
                f"webdataset {r['webdataset']:,.0f}/s, ceiling {r['ceiling']:,.0f}/s -> "
                f"{r['ae_vs_webdataset']:.1f}x webdataset, {r['ae_vs_ceiling']:.2f}x ceiling"
            )
    path = write_record(
        "input_pipeline",
        {
            "batch_size": BATCH,
            "rows": rows,
            "targets": {"npy_vs_wds": 10, "npy_vs_ceiling": 0.5, "png_vs_wds": 1.5},
        },
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
