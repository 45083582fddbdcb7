"""Input pipeline throughput, 1 rank, 0/1/2 workers: ae vs plain webdataset vs the parse ceiling.

Four datasets: 64-dim float32 `.npy` vectors (ae's writer), 32x32 RGB PNGs (native size),
real-photo JPEGs of 500x400 taken to 64x64 (`--image_size=64`), all in batches of 256, and
`vec`: 64-dim float32 vectors in shards written by WebDataset's `TarWriter` (a pax header per
member), indexed as `ae-shards index` does, in batches of 4096 (`--vec_batch`). For `vec` ae is
timed three times: `ae` (the columnar path, `ae.data.stream.fixed_layout_batches`), `ae_general`
(sample by sample, what other shards take), and with workers `ae_new_segments` (a new
shared-memory segment per batch instead of the workers' reused buffers), all over several epochs
through the trainer's loader settings (persistent workers, prefetch), as training reads them.

- ae: `ShardStream` (the trainer's dataset) through a DataLoader, whole batches to the main
  process, exactly as training gets them (shuffle buffer on; JPEGs: random crops).
- webdataset: `WebDataset(urls).decode().to_tuple(field).batched(B)` through a DataLoader; JPEGs:
  `.decode("pil")` plus the same Pillow resize and crop (`ae.data.decoding.images.fit`) in a `.map`.
- ceiling: read each shard's bytes, cut members at their 512-byte headers, `np.frombuffer` the
  `.npy` payload past its header (PNG: Pillow decode; JPEG: ae's drafted decode and resize); no
  grouping, batching or shuffling. With workers, each worker parses its share of the shards and
  returns only a count.

Usage: python -m bench.input_pipeline [--quick]   (writes bench/results/input_pipeline[_quick].json)

`--quick` (the suite's smoke run): every reader once over a few small batches of each kind
(`QUICK_BATCH`), 0 and 2 workers, `vec` for one epoch (not epochs for 3 s), the JPEG decode
timed in one round.
"""

from __future__ import annotations

import argparse
import io
import os
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch
import webdataset as wds
from PIL import Image
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from ae.config import PREFETCH_FACTOR
from ae.data.decoding.decode import SampleDecoder
from ae.data.decoding.images import decode_image, fit, to_array
from ae.data.planning.counts import count_shards
from ae.data.stream.resume import ResumableLoader
from ae.data.stream.shard_stream import ShardStream
from bench.common import photo_shards, synthetic_shards, tarwriter_shards, write_record

BATCH = 256
VEC_BATCH = 4096
QUICK_BATCH = {"vec": 512, "npy": 64, "png": 64, "jpg": 32}  # --quick: one a worker, and more
VEC_EPOCHS_S = 3.0  # ae on `vec` reads epoch after epoch for at least this long
JPG_SIZE = 64
DECODERS = {
    "npy": SampleDecoder((("npy", None),), "vector", (64,)),
    "png": SampleDecoder((("png", None),), "image", (3, 32, 32)),
    "jpg": SampleDecoder((("jpg", None),), "image", (3, JPG_SIZE, JPG_SIZE), image_size=JPG_SIZE),
    "vec": SampleDecoder((("npy", None),), "vector", (64,)),
}


def _ceiling_parse(url: str, kind: str) -> int:
    data = Path(url).read_bytes()
    pos = n = 0
    while pos + 512 <= len(data) and data[pos] != 0:
        size = int(data[pos + 124 : pos + 136].rstrip(b" \0") or b"0", 8)
        body = data[pos + 512 : pos + 512 + size]
        regular = data[pos + 156] in b"0\0"  # not a pax header (TarWriter's) or a directory
        if regular and kind in ("npy", "vec"):
            hlen = int.from_bytes(body[8:10], "little")
            np.frombuffer(body, dtype=np.float32, offset=10 + hlen)
        elif regular and kind == "jpg":
            decode_image(body, "RGB", JPG_SIZE)
        elif regular:
            np.asarray(Image.open(io.BytesIO(body)))
        n += regular
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


def _ours(
    urls: list[str], kind: str, workers: int, batch: int, columnar: bool = True
) -> DataLoader:
    stream = ShardStream(
        split="bench",
        urls=urls,
        counts=count_shards(urls).counts,
        decoder=DECODERS[kind],
        batch_size=batch,
        rank=0,
        world_size=1,
        num_workers=workers,
        augment=True,  # as in training: random crops (JPEGs)
        columnar=columnar,
    )
    if kind != "vec":  # the figures of earlier rounds: one epoch, workers started for it
        prefetch = PREFETCH_FACTOR if workers else None
        return DataLoader(stream, batch_size=None, num_workers=workers, prefetch_factor=prefetch)
    return ResumableLoader(
        stream,
        batch_size=None,
        num_workers=workers,
        persistent_workers=workers > 0,
        prefetch_factor=PREFETCH_FACTOR if workers else None,
    )


def _ours_general(urls: list[str], kind: str, workers: int, batch: int) -> DataLoader:
    return _ours(urls, kind, workers, batch, columnar=False)


def _ours_new_segments(urls: list[str], kind: str, workers: int, batch: int) -> DataLoader:
    """`ae` with a new shared-memory segment for every batch, as before the workers' reused
    buffers (`ae.data.stream.batch_buffers`)."""
    loader = _ours(urls, kind, workers, batch)
    loader.dataset.released = None
    return loader


def _batch(kind: str, quick: bool, vec_batch: int = VEC_BATCH) -> int:
    return QUICK_BATCH[kind] if quick else vec_batch if kind == "vec" else BATCH


def _webdataset(urls: list[str], kind: str, workers: int, batch: int) -> DataLoader:
    ds = wds.WebDataset(
        urls, shardshuffle=False, workersplitter=wds.split_by_worker, empty_check=False
    )
    if kind == "jpg":
        ds = ds.decode("pil").map_dict(jpg=_resized)
    else:
        ds = ds.decode(*(["rgb"] if kind == "png" else []))
    field = "npy" if kind == "vec" else kind
    batched = ds.to_tuple(field).batched(batch)
    return DataLoader(batched, batch_size=None, num_workers=workers)


def _resized(img: Image.Image) -> np.ndarray:
    """The same Pillow resize and crop as ae's, on WebDataset's decoded image."""
    return to_array(fit(img, JPG_SIZE))


def _decode_only(urls: list[str], rounds: int) -> dict[str, float]:
    """Milliseconds per JPEG, decode and resize alone (no pipeline), both ways alternating over
    the same bytes in memory, best round each, in CPU time of this process (Pillow decodes in
    the calling thread): on a shared machine the wall clock also counts the time other
    processes held the core, which swung this ratio from 0.8x to 2.6x at a load of 8 on 2 cores."""
    from ae.data.shards.tar_samples import iter_samples

    blobs = [s["jpg"] for url in urls for s in iter_samples(url)]

    def webdataset_way(data: bytes) -> np.ndarray:  # what `.decode("pil")` does, then resize
        with io.BytesIO(data) as stream:
            img = Image.open(stream)
            img.load()
            img = img.convert("RGB")
        return _resized(img)

    ways = {"ae": lambda d: decode_image(d, "RGB", JPG_SIZE), "webdataset": webdataset_way}
    best = dict.fromkeys(ways, float("inf"))
    for _ in range(rounds):
        for name, decode in ways.items():
            t0 = time.process_time()
            for data in blobs:
                decode(data)
            best[name] = min(best[name], (time.process_time() - t0) / len(blobs) * 1e3)
    return best


def _ceiling(urls: list[str], kind: str, workers: int, batch: int) -> DataLoader:
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


def _rate(loader: DataLoader, expect: int, epochs_s: float) -> tuple[float, float]:
    """Samples per second of wall time, and per second of this process's CPU time (all of the
    work with 0 workers; the figure that other processes on a shared machine disturb least).
    A `ResumableLoader` reads epoch after epoch for `epochs_s`."""
    t0, c0 = time.perf_counter(), time.process_time()
    n = _count(loader)
    dt, dc = time.perf_counter() - t0, time.process_time() - c0
    if isinstance(loader, ResumableLoader):  # epoch after epoch, as training reads
        epoch = 0
        while dt < epochs_s:
            epoch += 1
            loader.dataset.epoch = epoch
            n += _count(loader)
            dt, dc = time.perf_counter() - t0, time.process_time() - c0
        expect *= epoch + 1
    assert n >= expect * 0.95, (n, expect)  # a pipeline that skips data is not faster
    return n / dt, n / dc


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="smaller data, for a smoke run")
    ap.add_argument("--data", default="/tmp/ae-bench-data")
    ap.add_argument("--kinds", default="vec,npy,png,jpg", help="datasets, comma-separated")
    ap.add_argument("--workers", help="dataloader worker counts to run (0,1,2; --quick: 0,2)")
    ap.add_argument(
        "--repeat", type=int, default=1,
        help="rounds, the readers alternating; each reader's best round counts (a shared machine)",
    )  # fmt: skip
    ap.add_argument("--vec_batch", type=int, default=VEC_BATCH, help="batch size of `vec`")
    args = ap.parse_args()
    args.workers = args.workers or ("0,2" if args.quick else "0,1,2")
    epochs_s = 0.0 if args.quick else VEC_EPOCHS_S
    sizes = {  # (shards, samples per shard); --quick: a smoke run of seconds
        "vec": (2, 1024) if args.quick else (8, 25000),
        "npy": (2, 256) if args.quick else (8, 25000),
        "png": (2, 128) if args.quick else (8, 4000),
        "jpg": (2, 64) if args.quick else (4, 200),  # a batch of 256 for each of 2 workers
    }
    rows = []
    for kind in args.kinds.split(","):
        shards, per_shard = sizes[kind]
        if kind == "jpg":
            urls = photo_shards(Path(args.data), shards, per_shard)
        elif kind == "vec":
            urls = tarwriter_shards(Path(args.data), shards, per_shard)
        else:
            urls = synthetic_shards(Path(args.data), kind, shards, per_shard)
        total = shards * per_shard
        for workers in (int(w) for w in args.workers.split(",")):
            r: dict = {"kind": kind, "workers": workers, "repeat": args.repeat}
            r["batch_size"] = batch = _batch(kind, args.quick, args.vec_batch)
            readers = [("ae", _ours), ("webdataset", _webdataset), ("ceiling", _ceiling)]
            if kind == "vec":
                readers.insert(1, ("ae_general", _ours_general))
                if workers:
                    readers.insert(1, ("ae_new_segments", _ours_new_segments))
            for _ in range(args.repeat):
                for name, make in readers:
                    wall, cpu = _rate(make(urls, kind, workers, batch), total, epochs_s)
                    r[name] = max(r.get(name, 0.0), wall)
                    if workers == 0:
                        r[f"{name}_cpu"] = max(r.get(f"{name}_cpu", 0.0), cpu)
            r["ae_vs_webdataset"] = r["ae"] / r["webdataset"]
            r["ae_vs_ceiling"] = r["ae"] / r["ceiling"]
            r["load_average"] = os.getloadavg()[0]
            cpu_ratio = ""
            if workers == 0:
                r["ae_vs_webdataset_cpu"] = r["ae_cpu"] / r["webdataset_cpu"]
                cpu_ratio = f" ({r['ae_vs_webdataset_cpu']:.1f}x in CPU time)"
            rows.append(r)
            general = f"ae_general {r['ae_general']:,.0f}/s, " if "ae_general" in r else ""
            if "ae_new_segments" in r:
                r["ae_vs_new_segments"] = r["ae"] / r["ae_new_segments"]
                general += (
                    f"ae_new_segments {r['ae_new_segments']:,.0f}/s "
                    f"({r['ae_vs_new_segments']:.2f}x), "
                )
            print(
                f"{kind} batch={r['batch_size']} workers={workers}: ae {r['ae']:,.0f}/s, {general}"
                f"webdataset {r['webdataset']:,.0f}/s, ceiling {r['ceiling']:,.0f}/s -> "
                f"{r['ae_vs_webdataset']:.1f}x webdataset{cpu_ratio}, "
                f"{r['ae_vs_ceiling']:.2f}x ceiling (load {r['load_average']:.1f})",
                flush=True,
            )
    decode_ms = None
    if "jpg" in args.kinds.split(","):
        rounds = 1 if args.quick else 3 * args.repeat
        decode_ms = _decode_only(photo_shards(Path(args.data), *sizes["jpg"]), rounds)
        print(
            f"jpg decode+resize alone (CPU time): ae {decode_ms['ae']:.3f} ms, webdataset "
            f"{decode_ms['webdataset']:.3f} ms per image -> "
            f"{decode_ms['webdataset'] / decode_ms['ae']:.1f}x"
        )
    path = write_record(
        "input_pipeline",
        {
            "batch_size": _batch("npy", args.quick),
            "rows": rows,
            "jpg_decode_ms": decode_ms,
            "targets": {
                "vec_samples_per_s_0_workers": 2_000_000,
                "vec_samples_per_s_2_workers": 1_000_000,
                "vec_vs_wds": 100,
                "npy_vs_wds": 10,
                "npy_vs_ceiling": 0.5,
                "png_vs_wds": 1.5,
                "jpg_vs_wds": 2,
            },
        },
        quick=args.quick,
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
