"""Shard planning cost for large shard sets: time and peak memory (a benchmark, not a test).

For each case (number of shards x samples per shard) it builds a dataset folder of sparse shard
files with real index sidecars (line 1: count and size; line 2: one offset per sample), then, in
a fresh child process so that peak RSS belongs to that case alone, measures what a rank does in
`setup()`:
  count  - no cache: read every sidecar's first line, write the count cache;
  cached - a later run (any --output_dir): read the count cache;
  plan   - the epoch plan and the slices of every slot for 64 ranks x 8 workers.
Peak RSS is reported above the child's RSS after imports. It should grow with the shard count
and stay flat with the sample count.

Usage: python -m bench.plan_bench   (writes bench/results/plan_bench.json)
       python -m bench.plan_bench --quick   (1/100 of the shards: plan_bench_quick.json)
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path

from bench.common import write_record

ROOT = Path(__file__).resolve().parent.parent
# (shards, samples per shard): 10x and 30x the shards at 100 samples; 100x the samples at 10k
CASES = [(1_000, 100), (10_000, 100), (30_000, 100), (10_000, 10_000)]
QUICK_CASES = [(10, 100), (100, 100), (300, 100), (100, 10_000)]  # the same ratios, 1/100
WORLD, WORKERS, BATCH = 64, 8, 256
SAMPLE_BYTES = 1024


def build(folder: Path, shards: int, per_shard: int) -> list[str]:
    """Sparse shards (right size, no data: planning never opens them) with real sidecars."""
    from ae.data.shards.index import FORMAT, VERSION

    size = per_shard * SAMPLE_BYTES + 1024
    head = json.dumps({"format": FORMAT, "version": VERSION, "samples": per_shard, "bytes": size})
    offsets = json.dumps({"offsets": list(range(0, per_shard * SAMPLE_BYTES, SAMPLE_BYTES))})
    sidecar = f"{head}\n{offsets}\n"
    folder.mkdir(parents=True)
    urls = []
    for i in range(shards):
        path = folder / f"s-{i:06d}.tar"
        with open(path, "wb") as f:
            f.truncate(size)
        (folder / f"s-{i:06d}.tar.idx").write_text(sidecar)
        urls.append(str(path))
    return urls


def rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def _plan(urls: list[str], run_dir: Path) -> tuple[float, float, float, int]:
    """(count s, cached s, plan s, slices): what the ranks of a node do in setup()."""
    from ae.data.planning.counts import shared_counts
    from ae.data.planning.plan import plan_epoch

    t0 = time.perf_counter()
    counts = shared_counts("train", urls, run_dir)  # no cache yet: reads every sidecar
    t_count = time.perf_counter() - t0
    t0 = time.perf_counter()
    cached = shared_counts("train", urls, run_dir)  # a later run: reads the count cache
    t_cached = time.perf_counter() - t0
    assert cached.counts == counts.counts and counts.indexed == len(urls)
    t0 = time.perf_counter()
    plan = plan_epoch(counts.counts, world_size=WORLD, num_workers=WORKERS, batch_size=BATCH)
    slices = sum(len(plan.slot_slices(r, w)) for r in range(WORLD) for w in range(WORKERS))
    return t_count, t_cached, time.perf_counter() - t0, slices


def child(folder: Path, run_dir: Path) -> dict:
    """One case, in this fresh process: timed once, then again under tracemalloc (which slows
    Python down) for the peak bytes that planning allocates."""
    import ae.data.planning.counts  # noqa: F401 - imports (torch...) belong to the baseline RSS

    urls = sorted(str(p) for p in folder.glob("*.tar"))
    base = rss_mb()
    t_count, t_cached, t_plan, slices = _plan(urls, run_dir / "timed")
    tracemalloc.start()
    _plan(urls, run_dir / "traced")
    traced_peak = tracemalloc.get_traced_memory()[1] / 2**20
    tracemalloc.stop()
    return {
        "shards": len(urls),
        "count_s": round(t_count, 3),
        "cached_s": round(t_cached, 3),
        "plan_s": round(t_plan, 3),
        "planning_s": round(t_count + t_plan, 3),
        "slot_slices": slices,
        "alloc_peak_mb": round(traced_peak, 2),
        "rss_base_mb": round(base, 1),
        "rss_peak_mb": round(rss_mb(), 1),
    }


def run_case(folder: Path, shards: int, per_shard: int) -> dict:
    t0 = time.perf_counter()
    build(folder, shards, per_shard)
    print(f"built {shards} shards x {per_shard} samples in {time.perf_counter() - t0:.0f}s")
    cmd = [sys.executable, "-m", "bench.plan_bench", "--child", str(folder), str(folder / "run")]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, check=True)
    return {**json.loads(out.stdout.strip().splitlines()[-1]), "samples_per_shard": per_shard}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--child", nargs=2, metavar=("FOLDER", "RUN_DIR"), help=argparse.SUPPRESS)
    parser.add_argument("--quick", action="store_true", help="1/100 of the shards: a smoke run")
    args = parser.parse_args()
    if args.child:
        sys.stdout.write(json.dumps(child(Path(args.child[0]), Path(args.child[1]))) + "\n")
        return 0
    results = []
    cases = QUICK_CASES if args.quick else CASES
    with tempfile.TemporaryDirectory(prefix="plan_bench_") as tmp:
        for shards, per_shard in cases:
            row = run_case(Path(tmp) / f"{shards}x{per_shard}", shards, per_shard)
            results.append(row)
            print(
                f"{shards:>6} shards x {per_shard:>6} samples: count {row['count_s']:.3f}s, "
                f"cached {row['cached_s']:.3f}s, plan {row['plan_s']:.3f}s "
                f"(planning {row['planning_s']:.3f}s); planning allocates "
                f"{row['alloc_peak_mb']:.2f} MB at peak; peak RSS {row['rss_peak_mb']:.0f} MB "
                f"({row['rss_base_mb']:.0f} MB after imports)"
            )
    few, base, more, dense = results  # the cases in order: named by the full run's sizes

    def ratio(a: dict, b: dict, key: str) -> float:
        return a[key] / max(b[key], 1e-9)

    ratios = {
        "alloc_10k_over_1k_shards": ratio(base, few, "alloc_peak_mb"),
        "alloc_30k_over_10k_shards": ratio(more, base, "alloc_peak_mb"),
        "alloc_100x_samples_per_shard": ratio(dense, base, "alloc_peak_mb"),
        "rss_peak_100x_samples_per_shard": ratio(dense, base, "rss_peak_mb"),
    }
    for name, value in ratios.items():
        print(f"{name}: {value:.2f}")
    path = write_record(
        "plan_bench",
        {
            "plan": {"world_size": WORLD, "workers": WORKERS, "batch_size": BATCH},
            "cases": results,
            "ratios": {k: round(v, 2) for k, v in ratios.items()},
        },
        quick=args.quick,
    )
    print(f"written: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
