"""ae against its peers: WebDataset, litdata and MosaicML streaming, on the same generated data.

Two datasets, written once (cached under `--data`) in each library's own format, the writing
timed (conversion):

- `vec`: 200,000 x 64 float32 vectors, batch 4096. WebDataset's `TarWriter` shards (ae and
  webdataset read the same tars; ae adds its index sidecar, `ae-shards index`, timed apart),
  litdata's `optimize` chunks, MosaicML's `MDSWriter` shards.
- `jpg`: 256x256 RGB JPEGs (quality 90, smooth synthetic pictures, all distinct) taken to 64x64
  float32 (C, H, W) in [0, 1], batch 256. The same bytes in every format.

Each reader goes through its library's intended PyTorch path with shuffling on and, with workers,
persistent workers: ae through `ShardDataModule.train_dataloader()` (the loader a training run
takes batches from, as `ae-shards bench` does), webdataset through `WebDataset(...).shuffle(1000)`
`.batched(B)` in a DataLoader, litdata through `StreamingDataset` + `StreamingDataLoader`,
MosaicML through `StreamingDataset` + a DataLoader. Reported per reader, for 0 and 2 workers:
samples/s of the first epoch (worker start-up included) and of the next (warm) epoch, and the
ratio of ae to each peer in the same run.

Fairness, shown both ways where a peer needs a setting:
- JPEG decode: a peer's plain way decodes the full 256x256 picture with Pillow and resizes it
  (`*_full` rows); its `*_draft` row does ae's decode work (Pillow `draft()`: the JPEG decoded at
  1/4 scale, then the same resize), written as a peer's user would write it, with Pillow; and
  `litdata_turbo` gives the fastest peer ae's own decoder library too (TurboJPEG at the same
  scale, `ae.data.decoding.jpeg`), so the pipeline around the decode is all that differs.
- litdata's `batch_decode` (vectors): `litdata` keeps its defaults (items deserialized in
  windows of 256, the shuffle permuting within aligned windows); `litdata_item` decodes item by
  item with a full in-chunk shuffle (`batch_decode=0, item_shuffle_window="full"`).
Rates are wall clock and, as the figure a shared machine disturbs least, samples per CPU second
of the process and its workers; `--repeat` rounds alternate the readers, and the medians count.

And the bytes a sample costs from a slow source: the vector tars served over http on localhost
through a rate limit (`--rate_mb`), read by ae plain and gzip'd (`.tar.gz`: the 512-byte headers
and padding of every member compress to almost nothing).

Usage: python -m bench.peers [--quick]   (writes bench/results/peers[_quick].json)
Needs the `peers` extra: pip install -e '.[peers]' -c <(echo torch==$(python -c 'import torch;
print(torch.__version__.split("+")[0])'))   (torch held at the installed version)
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import os
import statistics
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import psutil
import torch

from ae.data.decoding.gpu_jpeg import gpu_decode_problem
from ae.data.shards.index import write_index
from ae.data.shards.tar_header_count import scan_shard
from bench.common import write_record
from bench.peer_data import (
    JPG_BATCH,
    PEERS,
    VEC_BATCH,
    du,
    extra_installed,
    gzip_tars,
    make_jpegs,
    make_vectors,
    peer_versions,
    serve,
    timed,
    write_litdata,
    write_mds,
    write_tars,
)
from bench.peer_readers import GPU, READERS, gpu_pixel_difference, read_ae, variants


def ae_index(urls: list[str]) -> None:
    """ae's index sidecar of each tar (what `ae-shards index` writes)."""
    for url in urls:
        scan = scan_shard(url)
        write_index(Path(url), scan.samples, scan.offsets)


def prepare(
    kind: str, n: int, shards: int, batch: int, root: Path, peers: dict[str, str]
) -> dict[str, Any]:
    """Every format of one dataset (of the installed `peers`), written afresh: the writing is
    the conversion figure."""
    root = root / f"{kind}-{n}"
    data = make_vectors(n) if kind == "vec" else make_jpegs(n)
    urls, tar_s = write_tars(kind, data, root / "tars", shards)
    index_s = timed(lambda: ae_index(urls))
    info: dict[str, Any] = {"samples": n, "batch": batch, "tar_urls": urls}
    info["count_cache"] = str(root / "ae-counts")  # local for the remote (throttled) reads too
    info["convert_s"] = {"webdataset_tarwriter": tar_s, "ae_index": index_s}
    info["bytes"] = {
        "payload": int(data.nbytes) if kind == "vec" else sum(map(len, data)),
        "tar": du(urls),
        "ae_index": du([u + ".idx" for u in urls if Path(u + ".idx").exists()]),
    }
    if "litdata" in peers:
        info["convert_s"]["litdata_optimize"] = write_litdata(kind, data, root / "litdata")
        info["bytes"]["litdata"] = du(root / "litdata")
    if "mosaicml-streaming" in peers:
        info["convert_s"]["mosaicml_mdswriter"] = write_mds(kind, data, root / "mds")
        info["bytes"]["mds"] = du(root / "mds")
    info["dirs"] = {"litdata": str(root / "litdata"), "mds": str(root / "mds")}
    return info


def _batch_len(batch: Any) -> int:
    while isinstance(batch, (list, tuple, dict)):
        batch = next(iter(batch.values())) if isinstance(batch, dict) else batch[0]
    return len(batch)


MIN_CPU_S = 0.2  # the least CPU time a pass needs for its per-CPU-second figure


def tree_cpu_s() -> float:
    """CPU seconds so far of this process and its children alive (the loader's workers): on a
    shared machine the figure that other processes disturb least."""
    me = psutil.Process()
    total = 0.0
    for proc in (me, *me.children(recursive=True)):
        with contextlib.suppress(psutil.Error):
            times = proc.cpu_times()
            total += times.user + times.system
    return total


def epoch_rate(loader: Iterable[Any], cap_s: float) -> tuple[float, float, int, bool]:
    """(samples/s, samples per CPU second of the process tree, samples, whole epoch?) of one
    pass, stopped after `cap_s` seconds (a slow peer's epoch of 200,000 vectors takes minutes on
    2 cores): from the iterator's creation (workers start there) to the last batch taken."""
    n, t0, c0 = 0, time.perf_counter(), tree_cpu_s()
    it = iter(loader)
    whole = True
    for batch in it:
        n += _batch_len(batch)
        if time.perf_counter() - t0 > cap_s:
            whole = False
            break
    dt, dc = time.perf_counter() - t0, tree_cpu_s() - c0
    del it
    # CPU times tick at 10 ms: a shorter pass (ae's vectors in --quick) gets no CPU figure
    return n / dt, n / dc if dc >= MIN_CPU_S else None, n, whole


def _median(values: Iterable[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return statistics.median(known) if known else None


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b is not None else None


def end_workers(loader: Iterable[Any]) -> None:
    """Shut a loader's persistent workers down now. Left to the garbage collector, the loader's
    cycle is torn down in any order, and litdata's workers then wait out torch's 5 s join
    timeout each (10 s of idle per litdata row with 2 workers; measured)."""
    iterator = getattr(loader, "_iterator", None)  # torch keeps persistent workers' iterator
    if iterator is not None and hasattr(iterator, "_shutdown_workers"):
        iterator._shutdown_workers()


def measure(info: dict, kind: str, name: str, reader: str, variant: str, workers: int,
            cap_s: float) -> dict[str, Any]:  # fmt: skip
    t0 = time.perf_counter()
    loader, set_epoch = READERS[reader](info, kind, workers, variant)
    setup_s = time.perf_counter() - t0
    row: dict[str, Any] = {"setup_s": setup_s}
    for epoch, label in enumerate(("first", "warm")):
        set_epoch(epoch)
        rate, per_cpu_s, n, whole = epoch_rate(loader, cap_s)
        row[label] = rate
        row[f"{label}_per_cpu_s"] = per_cpu_s
        row[f"{label}_samples"] = n
        row[f"{label}_whole"] = whole
    end_workers(getattr(loader, "loader", loader))  # `_OnDevice`: its loader's workers
    del loader
    if reader == "mosaicml":  # its shared memory ends with its dataset (a cycle), before the next
        gc.collect()  # a second or more with the peers imported: not after every reader
    return row


# --- the throttled source -----------------------------------------------------------------


def throttled(info: dict, rate_mb: float, workers: int, cap_s: float) -> list[dict[str, Any]]:
    """ae reading the vector tars over http at `rate_mb` MB/s per shard stream, plain and gzip'd
    (one epoch each), each with its index sidecar beside it (the count; a gzip'd shard's has no
    offsets), as `ae-shards write` leaves them."""
    urls = info["tar_urls"]
    gzipped = gzip_tars(urls)
    for url, gz in zip(urls, gzipped, strict=True):  # as `ae-shards write --compress gz` does
        write_index(Path(gz), scan_shard(url).samples, None)
    rows = []
    for label, files in (("plain", urls), ("gzip", gzipped)):
        folder = Path(files[0]).parent
        server, base = serve(folder, rate_mb * 1e6)
        remote = [f"{base}/{Path(f).name}" for f in files]
        remote_info = {**info, "tar_urls": remote}
        try:
            t0 = time.perf_counter()
            loader, _ = read_ae(remote_info, "vec", workers, "")
            setup_s = time.perf_counter() - t0
            rate, _, n, whole = epoch_rate(loader, cap_s)
        finally:
            server.shutdown()
        size = du(files)
        rows.append({
            "shards": label, "workers": workers, "rate_mb_per_s": rate_mb, "bytes": size,
            "bytes_per_sample": size / info["samples"], "setup_s": setup_s,
            "samples_per_s": rate, "samples": n, "whole_epoch": whole,
        })  # fmt: skip
        print(f"throttled {rate_mb} MB/s, {workers} workers, {label} ({size / 1e6:.1f} MB): "
              f"{rate:,.0f} samples/s (setup/count {setup_s:.1f} s)", flush=True)  # fmt: skip
    return rows


# --- main ---------------------------------------------------------------------------------


RATES = ("first", "warm", "warm_per_cpu_s")  # each row's rates, compared between rows


def _device() -> str:
    """What the run ran on: the GPU's name (the ae_gpu row), or the CPU count."""
    cpus = f"{os.cpu_count()} CPUs"
    return f"{torch.cuda.get_device_name()}, {cpus}" if torch.cuda.is_available() else cpus


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="small data, for a smoke run")
    ap.add_argument("--data", default="/tmp/ae-bench-data/peers")
    ap.add_argument("--kinds", default="vec,jpg")
    ap.add_argument("--workers", default="0,2")
    ap.add_argument("--repeat", type=int, help="rounds, readers alternating; the median counts")
    ap.add_argument("--epoch_cap_s", type=float, help="stop an epoch after this long")
    ap.add_argument("--rate_mb", type=float, default=20.0, help="throttled source, MB/s")
    ap.add_argument(
        "--readers",
        default=None,
        help="rows to run beside ae, comma-separated (e.g. litdata_turbo; default all)",
    )
    args = ap.parse_args()
    chosen = set(args.readers.split(",")) | {"ae"} if args.readers else None
    versions = peer_versions()
    if not extra_installed(versions):
        print(f"skipped: the peers extra is not installed ({', '.join(PEERS)})")
        return
    if missing := [p for p in PEERS if p not in versions]:
        print(f"not installed, their rows left out: {', '.join(missing)}")
    gpu = gpu_decode_problem() is None  # the `ae_gpu` row: --image_decode=gpu
    if not gpu:
        print(f"no ae_gpu row (--image_decode=gpu): {gpu_decode_problem()}")
    os.environ.setdefault("LITDATA_DISABLE_VERSION_CHECK", "1")  # no PyPI call per dataset
    from loguru import logger

    logger.remove()  # ae's per-epoch INFO lines (no logging is configured in a bench)
    repeat = args.repeat or (1 if args.quick else 2)
    cap_s = args.epoch_cap_s or (1.0 if args.quick else 20.0)
    # (samples, tar shards, batch): --quick only checks that every reader runs, in seconds
    sizes = {
        "vec": (2_048, 2, 256) if args.quick else (200_000, 8, VEC_BATCH),
        "jpg": (128, 2, 16) if args.quick else (4_096, 8, JPG_BATCH),
    }
    workers_list = [int(w) for w in args.workers.split(",")]
    datasets, rows = {}, []
    for kind in args.kinds.split(","):
        info = prepare(kind, *sizes[kind], Path(args.data), versions)
        datasets[kind] = {
            k: v for k, v in info.items() if k not in ("tar_urls", "dirs", "count_cache")
        }
        print(f"{kind}: convert {info['convert_s']}, bytes {info['bytes']}", flush=True)
        if kind == "jpg" and gpu:
            datasets[kind]["gpu_vs_cpu_pixels"] = gpu_pixel_difference(info, GPU)
            print(f"jpg: --image_decode=gpu vs cpu {datasets[kind]['gpu_vs_cpu_pixels']}")
        for workers in workers_list:
            runs: dict[str, list[dict]] = {}
            for _ in range(repeat):
                for name, reader, variant in variants(kind, versions, gpu):
                    if chosen is not None and name not in chosen:
                        continue
                    r = measure(info, kind, name, reader, variant, workers, cap_s)
                    runs.setdefault(name, []).append(r)
            row: dict[str, Any] = {"kind": kind, "workers": workers, "readers": {}}
            for name, rs in runs.items():
                row["readers"][name] = {
                    "first": statistics.median(r["first"] for r in rs),
                    "warm": statistics.median(r["warm"] for r in rs),
                    "warm_per_cpu_s": _median(r["warm_per_cpu_s"] for r in rs),
                    "setup_s": statistics.median(r["setup_s"] for r in rs),
                    "whole_epochs": all(r["first_whole"] and r["warm_whole"] for r in rs),
                }
            for ours in ("ae", "ae_gpu"):  # each of ae's rows against every other row
                if (mine := row["readers"].get(ours)) is not None:
                    row[f"{ours}_vs"] = {
                        name: {
                            e: _ratio(mine[e], r[e]) for e in ("first", "warm", "warm_per_cpu_s")
                        }
                        for name, r in row["readers"].items()
                        if name != ours
                    }
            row["load_average"] = os.getloadavg()[0]
            rows.append(row)
            for name, r in row["readers"].items():
                vs = row["ae_vs"].get(name) if name != "ae_gpu" else None
                cpu = r["warm_per_cpu_s"]
                line = f"{kind} w={workers} {name:18s} first {r['first']:>11,.0f}/s  warm "
                line += f"{r['warm']:>11,.0f}/s  " + (f"{cpu:>11,.0f}/CPU s" if cpu else " " * 17)
                if vs:
                    line += f"  ae {vs['warm']:.2f}x"
                    if vs["warm_per_cpu_s"]:
                        line += f" ({vs['warm_per_cpu_s']:.2f}x per CPU s)"
                if (gvs := row.get("ae_gpu_vs", {}).get(name)) is not None:
                    line += f"  ae_gpu {gvs['warm']:.2f}x"
                    if gvs["warm_per_cpu_s"]:
                        line += f" ({gvs['warm_per_cpu_s']:.2f}x per CPU s)"
                print(line, flush=True)
        if kind == "vec":
            datasets[kind]["throttled"] = [
                row for w in workers_list for row in throttled(info, args.rate_mb, w, cap_s * 3)
            ]
    record = {
        "versions": versions,
        "missing": missing,
        "device": _device(),
        "batch_size": {k: sizes[k][2] for k in datasets},
        "repeat": repeat,
        "epoch_cap_s": cap_s,
        "datasets": datasets,
        "rows": rows,
    }
    path = write_record("peers", record, quick=args.quick)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
