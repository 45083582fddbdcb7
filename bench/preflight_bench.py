"""Preflight: what checking the machine's limits adds to a run's startup, and what the heartbeat's
`resources` cost per write.

Baseline, measured in the same run: the launcher's own startup up to its config (`python -m
ae.cli.launch --print_config`, a fresh interpreter, best of 3). Measured: the launcher's
preflight (`launcher_needs` + `check`), a rank's (`rank_needs` + `check`, plus summing the state
dict of a 25M-parameter model, as `ae.rank.train.preflight` does), and one `ResourceReader.sample()`
(each the median of 200 calls). Target: the preflight adds < 1 s to startup.

Usage: python -m bench.preflight_bench   (writes bench/results/preflight_bench.json)
       python -m bench.preflight_bench --quick   (one launcher start, 20 calls each)
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from ae.config import PREFETCH_FACTOR, parse_config
from ae.forensics.resources import ResourceReader
from ae.job.preflight import check, launcher_needs, rank_needs
from bench.common import write_record

ROOT = Path(__file__).resolve().parents[1]
OUT = Path("/tmp/ae-bench-preflight")


def median_s(fn: Callable[[], object], n: int = 200) -> float:
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def launcher_startup_s(tries: int) -> float:
    best = float("inf")
    for _ in range(tries):
        t0 = time.perf_counter()
        subprocess.run([sys.executable, "-m", "ae.cli.launch", f"--output_dir={OUT}",
                        "--print_config"], cwd=ROOT, capture_output=True, check=True)  # fmt: skip
        best = min(best, time.perf_counter() - t0)
    return best


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="a smoke run: fewer repeats")
    args = ap.parse_args()
    tries, calls = (1, 20) if args.quick else (3, 200)
    cfg = parse_config([f"--output_dir={OUT}", "--num_workers=4"])
    model = torch.nn.Sequential(*(torch.nn.Linear(2500, 2500) for _ in range(4)))  # 25M params

    def rank_preflight() -> None:
        state = sum(t.numel() * t.element_size() for t in model.state_dict().values())
        needs = rank_needs(cfg, batch_bytes=4 * 2**20, state_bytes=state, local_ranks=8,
                           world_size=16, prefetch=PREFETCH_FACTOR)  # fmt: skip
        check(needs)

    baseline = launcher_startup_s(tries)
    figures = {
        "launcher_startup_s": baseline,
        "launcher_preflight_s": median_s(lambda: check(launcher_needs(cfg, 8, 16, 4)), calls),
        "rank_preflight_s": median_s(rank_preflight, calls),
        "heartbeat_resources_s": median_s(ResourceReader(OUT).sample, calls),
    }
    for name, secs in figures.items():
        ratio = "" if name == "launcher_startup_s" else f"  ({secs / baseline:.2e} x the baseline)"
        print(f"{name:<24} {secs * 1e3:9.3f} ms{ratio}")
    print(f"wrote {write_record('preflight_bench', figures, quick=args.quick)}")


if __name__ == "__main__":
    main()
