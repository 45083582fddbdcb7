"""Startup: seconds from launch to the first optimizer step, 10 versus 10,000 shards.

Users of multi-GPU jobs report waiting many minutes on dataset metadata before the first step.
Here the launcher validates the spec, the ranks count samples from index sidecars (a share
each), plan their slices, workers start, and the first step runs; the clock starts when the launcher
process is spawned and stops at the timestamp of rank 0's first `Training step` line.
Target: under 5 s difference between 10 and 10,000 shards.

Usage: python -m bench.startup   (writes bench/results/startup.json)
       python -m bench.startup --quick   (10 vs 100 shards, one run each, one rank with one
                                         worker: startup_quick.json)
"""

from __future__ import annotations

import argparse
import time
from datetime import datetime
from pathlib import Path

from ae.log_lines import RECORD_PATTERN, TRAIN_STEP
from bench.common import launch_run, one_thread_per_process, tiny_shard_set, write_record

DATA = Path("/tmp/ae-bench-data")


def first_step_seconds(spec: str, out: Path, extra: list[str] | None = None) -> float:
    """Seconds from spawning the launcher to rank 0's first step; `extra` flags win."""
    t0 = time.time()
    proc = launch_run(
        [f"--train_shards={spec}", f"--val_shards={spec}", "--debug=true", "--max_steps=2",
         "--batch_size=64", "--num_workers=2", "--checkpointing_period=0", *(extra or [])],
        out,
    )  # fmt: skip
    if proc.wait(timeout=300) != 0:
        raise SystemExit(f"run failed; see {out}/logs")
    (log,) = (out / "logs").glob("debug_rank0_*.log")
    for line in log.read_text().splitlines():
        m = RECORD_PATTERN.match(line)
        if m and TRAIN_STEP.parse(m["message"]):
            stamp = datetime.strptime(m["time"], "%Y-%m-%d %H:%M:%S.%f").timestamp()
            return stamp - t0
    raise SystemExit(f"no Training step line in {log}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="10 vs 100 shards, one run each")
    args = ap.parse_args()
    cases, tries = (((10, 100), (100, 10)), 1) if args.quick else (((10, 1000), (10_000, 10)), 2)
    # quick: a launch costs ~8 s of CPU with one rank, ~14 with two (imports, mostly)
    extra = ["--devices=1", "--num_workers=1"] if args.quick else []
    if args.quick:
        one_thread_per_process()
    rows = []
    for shards, per_shard in cases:
        spec = tiny_shard_set(DATA, shards, per_shard)
        out = DATA / f"run-startup-{shards}"
        secs = [first_step_seconds(spec, out, extra) for _ in range(tries)]
        rows.append({"shards": shards, "samples": shards * per_shard, "seconds": min(secs)})
        print(f"{shards:>6} shards: first optimizer step after {min(secs):.1f} s (best of {tries})")
    diff = rows[1]["seconds"] - rows[0]["seconds"]
    print(f"difference: {diff:.1f} s (target < 5 s)")
    record = {"rows": rows, "difference_s": diff}
    print(f"wrote {write_record('startup', record, quick=args.quick)}")


if __name__ == "__main__":
    main()
