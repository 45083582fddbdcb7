"""Counting shards without index sidecars, and the startup it costs a 2-rank run.

1. **count**: samples/s counting WebDataset `TarWriter` shards (a 256-float `.npy` and a `cls`
   per sample, a PAX header per member as TarWriter writes them) in one process, page cache warm:
   `ae`'s header walk (`scan_shard`) versus the baseline it replaces, Python's `tarfile` seeking
   from header to header (the counting pass before issue 17), both in this run; and `ae-shards
   index` (walk + sidecar with offsets) with `--jobs 1` and `--jobs 2`.
2. **startup**: launch to rank 0's first `Training step` line, 2 ranks x 2 workers, over a set of
   >= 1,000,000 samples in >= 50 TarWriter shards without sidecars (`--write_index=never`, so only
   the count cache can spare the second run its count): the first run (the count cache empty),
   the second in a new `--output_dir` (it must not count), and `--shard_split=resampled` (no
   count at all). Each run's `Shard counts` line says where its counts came from.

Usage: python -m bench.count_bench [--quick] [--part count|startup]
       (writes bench/results/count_bench_<part>.json; --quick: count_bench_<part>_quick.json)

`--quick` (the suite's smoke run): 8,000 samples to count, and one launch for the startup part:
the first run (it counts, and fills the cache), one rank, 20,000 samples in 4 shards.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tarfile
import time
from pathlib import Path

import numpy as np

from ae.cli.shards import main as shards_main
from ae.data.shards.tar_header_count import scan_shard
from ae.data.shards.tar_samples import split_name
from bench.common import one_thread_per_process, tiny_shard_set, write_record
from bench.startup import first_step_seconds

DATA = Path("/tmp/ae-bench-data")


def tarwriter_shards(root: Path, shards: int, per_shard: int, dim: int) -> list[str]:
    """`shards` shards written by WebDataset's TarWriter, no sidecars (cached on disk)."""
    out = root / f"tarwriter-{shards}x{per_shard}x{dim}"
    urls = [str(out / f"shard-{i:06d}.tar") for i in range(shards)]
    if all(Path(u).exists() for u in urls):
        return urls
    import webdataset as wds  # imports torch (~2 s of CPU): only to write the shards

    out.mkdir(parents=True, exist_ok=True)
    rows = np.random.default_rng(0).random((per_shard, dim), dtype=np.float32)
    for i, url in enumerate(urls):
        tmp = url + ".tmp"
        with wds.TarWriter(tmp) as sink:
            for j in range(per_shard):
                sink.write({"__key__": f"{i * per_shard + j:09d}", "npy": rows[j], "cls": str(j)})
        os.replace(tmp, url)
    return urls


def tarfile_count(url: str) -> int:
    """The baseline: the counting pass before issue 17 (tarfile, seeking header to header)."""
    samples, last = 0, None
    with tarfile.open(url, "r:") as tar:
        while (info := tar.next()) is not None:
            tar.members.clear()
            parts = split_name(info.name) if info.isfile() else None
            if parts is not None and parts[0] != last:
                last, samples = parts[0], samples + 1
    return samples


def _rate(count, urls: list[str], repeats: int) -> tuple[float, float, int]:
    """(best samples/s of wall time, and of this process's CPU time, over `repeats` passes;
    samples). On a shared machine the CPU figure is the one that load does not divide."""
    wall = cpu = float("inf")
    total = 0
    for _ in range(repeats):
        t0, c0 = time.perf_counter(), time.process_time()
        total = sum(count(u) for u in urls)
        wall = min(wall, time.perf_counter() - t0)
        cpu = min(cpu, time.process_time() - c0)
    return total / wall, total / cpu, total


def count_rates(urls: list[str]) -> dict[str, float]:
    for url in urls:  # page cache warm
        Path(url).read_bytes()
    walk, walk_cpu, n = _rate(lambda u: scan_shard(u).samples, urls, 5)
    base, base_cpu, n_base = _rate(tarfile_count, urls[:1], 1)
    assert n_base * len(urls) == n, (n_base, n)
    out = {"samples": n, "walk_per_s": walk, "tarfile_per_s": base}
    out |= {"walk_per_cpu_s": walk_cpu, "tarfile_per_cpu_s": base_cpu}
    for jobs in (1, 2):
        t0 = time.perf_counter()
        shards_main(["index", str(Path(urls[0]).parent), "--force", "--jobs", str(jobs)])
        out[f"index_jobs{jobs}_per_s"] = n / (time.perf_counter() - t0)
    for url in urls:
        Path(url + ".idx").unlink()
    print(
        f"count {n} samples in {len(urls)} TarWriter shards: header walk {walk:,.0f}/s "
        f"({walk_cpu:,.0f}/s of CPU), tarfile {base:,.0f}/s ({base_cpu:,.0f}/s of CPU): "
        f"{walk / base:.1f}x ({walk_cpu / base_cpu:.1f}x of CPU); ae-shards index --jobs 1 "
        f"{out['index_jobs1_per_s']:,.0f}/s, --jobs 2 {out['index_jobs2_per_s']:,.0f}/s"
    )
    return out


def _counts_line(run: Path) -> str:
    (log,) = (run / "logs").glob("debug_rank0_*.log")
    lines = [line for line in log.read_text().splitlines() if "Shard counts train_shards" in line]
    return lines[0].split("] ", 1)[-1] if lines else "(no train count)"


def startup(urls: list[str], per_shard: int, quick: bool = False) -> list[dict]:
    """The three runs (`quick`: the first alone, one rank with one worker)."""
    spec = str(Path(urls[0]).parent / f"shard-{{000000..{len(urls) - 1:06d}}}.tar")
    val = tiny_shard_set(DATA, 2, 128, dim=16)  # a name of its own: sets are cached by shape
    cache = DATA / "count-cache"
    shutil.rmtree(cache, ignore_errors=True)
    os.environ["AE_CACHE_DIR"] = str(cache)  # the launcher hands it to the ranks
    common = [f"--val_shards={val}", "--write_index=never"]
    runs = [
        ("first run", []),
        ("second run, new --output_dir", []),
        ("resampled", ["--shard_split=resampled", f"--epoch_samples={len(urls) * per_shard}"]),
    ]
    if quick:
        runs, common = runs[:1], [*common, "--devices=1", "--num_workers=1"]
        one_thread_per_process()
    rows = []
    for name, extra in runs:
        run = DATA / f"run-count-{len(rows)}"
        secs = first_step_seconds(spec, run, [*common, *extra])
        line = _counts_line(run)
        rows.append({"run": name, "seconds": secs, "counts": line})
        print(f"{name:>30}: first optimizer step after {secs:.1f} s; {line}")
    return rows


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--quick", action="store_true", help="small sets: a smoke run")
    p.add_argument("--part", choices=["all", "count", "startup"], default="all")
    args = p.parse_args()
    shards, per_shard = (4, 2000) if args.quick else (4, 20_000)
    rates, rows = {}, []
    if args.part in ("all", "count"):
        rates = count_rates(tarwriter_shards(DATA, shards, per_shard, 256))
    big, big_per = (4, 5000) if args.quick else (50, 20_000)
    if args.part in ("all", "startup"):
        rows = startup(tarwriter_shards(DATA, big, big_per, 16), big_per, args.quick)
    load = os.getloadavg()
    print(f"load average {load[0]:.1f} {load[1]:.1f} {load[2]:.1f}")
    record = {"count": rates, "startup": rows, "load": load}
    path = write_record(f"count_bench_{args.part}", record, quick=args.quick)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
