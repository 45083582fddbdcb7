"""The cost of the per-rank series (`ae.training.rank_series`): what rank 0 spends reading the
heartbeats and handing the series to the loggers.

    .venv/bin/python -m bench.rank_series_bench [--ranks 8,64] [--repeats 200] [--quick]

Rank 0 does it after an optimizer step on the loggers' cadence (every 10 steps), and at most
once per MIN_READ_INTERVAL_S (1 s) of wall time. So its share of training time is at most
(read + log) / max(1 s, 10 steps): the figure below divides by 1 s, the worst case, whatever
the step time. Measured on real heartbeat records (`ae.forensics.heartbeat` writes them the
same way) for N ranks, with a CSVLogger and a TensorBoardLogger receiving the 4 x N series.
Writes bench/results/rank_series.json (`--quick`: rank_series_quick.json).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger

from ae.log_lines import HEARTBEAT_FILE
from ae.training.rank_series import MIN_READ_INTERVAL_S, rank_values, read_heartbeats
from bench.common import write_record

TS = "20260101_000000"


def heartbeat(rank: int) -> dict:
    """A heartbeat as a busy rank writes it: step times, two workers, resources."""
    window = {"window_s": 30.0, "steps": 900, "step_ms": 33.0, "own_ms": 20.0 + rank % 3,
              "data_ms": 5.0, "compute_ms": 15.0 + rank % 3, "sync_ms": 13.0}  # fmt: skip
    workers = [{"worker": w, "pid": 1000 + w, "shard": f"/data/train-{w:06d}.tar",
                "mb_per_s": 200.0, "batch_ms": 3.0, "batches": 400, "updated": 0.0}
               for w in range(2)]  # fmt: skip
    return {
        "rank": rank, "world_size": 0, "pid": 100 + rank, "host": "node0", "phase": "training step",
        "epoch": 0, "step": 900, "time": 0.0, "last_progress": 0.0, "idle_s": 0.0,
        "rss_mb": 2000.0, "workers": [{"pid": 1000 + w, "rss_mb": 300.0} for w in range(2)],
        "stalled": False, "state": "running", "timing": {"recent": window, "epoch": window},
        "data_workers": workers, "stragglers": [],
        "resources": {"shm_free_mb": 1000.0, "disk_free_mb": 1e6},
    }  # fmt: skip


def measure(ranks: int, repeats: int, root: Path) -> dict:
    logs = root / f"logs{ranks}"
    logs.mkdir()
    for r in range(ranks):
        beat = {**heartbeat(r), "world_size": ranks}
        (logs / HEARTBEAT_FILE.format(rank=r, ts=TS)).write_text(json.dumps(beat, indent=1))
    loggers = [CSVLogger(root, name=f"csv{ranks}"), TensorBoardLogger(root, name=f"tb{ranks}")]
    reads, logs_ms = [], []
    for step in range(repeats):
        t0 = time.perf_counter()
        values = rank_values(read_heartbeats(logs, TS))
        t1 = time.perf_counter()
        for lg in loggers:
            lg.log_metrics(values, step=step)
        t2 = time.perf_counter()
        reads.append((t1 - t0) * 1e3)
        logs_ms.append((t2 - t1) * 1e3)
    for lg in loggers:
        lg.finalize("success")
    assert len(values) == 4 * ranks, sorted(values)
    read, log = statistics.median(reads), statistics.median(logs_ms)
    return {
        "ranks": ranks,
        "series": len(values),
        "read_ms": round(read, 3),
        "log_ms": round(log, 3),
        # at most one read + log per MIN_READ_INTERVAL_S of training
        "worst_case_share_pct": round(100 * (read + log) / (MIN_READ_INTERVAL_S * 1e3), 3),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", default="8,64", help="rank counts, comma-separated")
    ap.add_argument("--repeats", type=int, default=200)
    ap.add_argument("--quick", action="store_true", help="2 and 8 ranks, 20 repeats: a smoke run")
    args = ap.parse_args()
    counts = [2, 8] if args.quick else [int(n) for n in args.ranks.split(",")]
    repeats = 20 if args.quick else args.repeats
    with tempfile.TemporaryDirectory() as tmp:
        rows = [measure(n, repeats, Path(tmp)) for n in counts]
    for row in rows:
        print(
            f"{row['ranks']:>3} ranks, {row['series']} series: read {row['read_ms']:.2f} ms, "
            f"log {row['log_ms']:.2f} ms -> at most {row['worst_case_share_pct']:.3f}% of "
            "training time"
        )
    print(f"wrote {write_record('rank_series', {'rows': rows}, quick=args.quick)}")


if __name__ == "__main__":
    main()
