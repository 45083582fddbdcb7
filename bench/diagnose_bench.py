"""How long `ae-diagnose --json` takes on a big run: 64 rank logs, ~200 MB in all.

The logs are synthesized with the real line formats (bench/synthetic_logs.py: RECORD_FORMAT and the
writers' LineFormats): per rank a header, the shard plans, 3 epochs of `--debug` training steps
with memory figures, validation lines, data-loading warnings and bad-shard ERRORs; a heartbeat
per rank; rank 37 ends in a data loading STALL with its report and worker dumps while every
other rank waits in the gradient all-reduce, and rank 12 has a long loguru traceback of a peer
failure. Then `python -m ae.diagnose <logs> --json` runs as a subprocess (interpreter start and
imports included, what a user waits for), REPEAT times; the median is the figure.

    .venv/bin/python -m bench.diagnose_bench           # writes bench/results/diagnose_bench.json
    .venv/bin/python -m bench.diagnose_bench --quick   # 64 logs of ~2 MB in all, run once
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench.common import results_dir, write_record
from bench.synthetic_logs import RankWriter, write_heartbeat, write_train_log

ROOT = Path(__file__).resolve().parent.parent
RANKS = 64
TARGET_MB = 200
TARGET_S = 10.0
REPEAT = 3
STUCK_RANK = 37
EPOCHS = 3
WAIT = "yes (DDP gradient all-reduce in backward)"


def write_rank(logs: Path, rank: int, steps_per_epoch: int) -> None:
    w = RankWriter(logs, rank, RANKS)
    w.start(batches=steps_per_epoch)
    step = 0
    for epoch in range(EPOCHS):
        w.log(f"========== EPOCH {epoch} TRAINING START ==========")
        for i in range(steps_per_epoch):
            step += 1
            w.steps(step, step, epoch, dt=0.02)
            if i % 2000 == 1999:
                w.log(f"Bad sample 0{i} in shard /data/train-{i % 97:06d}.tar: truncated", "ERROR")
                w.log("DataLoader is slow: 2.1 s for one batch", "WARNING")
            if len(w.lines) >= 20_000:
                w.flush()
        w.log(f"========== EPOCH {epoch} TRAINING END ==========")
        w.log(f"========== EPOCH {epoch} VALIDATION START ==========")
        for k in range(1, 41):
            w.log(f"Validation step {k}, loss=0.250000 (global step {step})", "DEBUG")
        w.log(f"========== EPOCH {epoch} VALIDATION END ==========")
    if rank == STUCK_RANK:
        w.stall("data loading", step, 301.0, frame="select (selectors.py:415)", report=1,
                worker_frame="read")  # fmt: skip
    else:
        w.stall("training step", step + 1, 300.0, collective=WAIT,
                frame="_engine_run_backward (torch/autograd/graph.py:979)")  # fmt: skip
    if rank == 12:  # an old peer failure of a dataloader thread, with loguru's long traceback
        w.fatal("RuntimeError", "Connection closed by peer [10.0.0.7]:29500",
                [("/x/torch/autograd/graph.py", "_engine_run_backward")] * 200,
                where="thread pin_memory")  # fmt: skip
    w.flush()
    beat_t = w.t + 1.0
    write_heartbeat(logs, rank, RANKS, pid=1_000_000 + rank, t=beat_t, phase="data loading",
                    step=step, stalled=True, host="node-bench")  # fmt: skip


def synthesize(logs: Path, target_mb: float) -> dict[str, Any]:
    """Build the logs once; reused when the folder already holds them."""
    marker = logs / "synthesized.json"
    if marker.exists():
        return json.loads(marker.read_text())
    logs.mkdir(parents=True, exist_ok=True)
    write_train_log(logs, RANKS, stall_timeout=300.0)
    # ~132 bytes per debug step line; 3 epochs; sized so the 64 logs total ~TARGET_MB.
    steps = int(target_mb * 2**20 / RANKS / 132 / EPOCHS)
    for rank in range(RANKS):
        write_rank(logs, rank, steps)
    files = sorted(logs.glob("debug_rank*.log"))
    info = {
        "ranks": RANKS,
        "files": len(list(logs.iterdir())),
        "debug_logs_mb": round(sum(p.stat().st_size for p in files) / 2**20, 1),
        "lines": sum(p.read_bytes().count(b"\n") for p in files),
        "steps_per_epoch": steps,
    }
    marker.write_text(json.dumps(info))
    return info


def time_diagnose(logs: Path, repeat: int) -> tuple[list[float], dict[str, Any]]:
    times, doc = [], {}
    for _ in range(repeat):
        t0 = time.perf_counter()
        out = subprocess.run(
            [sys.executable, "-m", "ae.diagnose", str(logs), "--json"],
            cwd=ROOT, capture_output=True, text=True, check=True,
        )  # fmt: skip
        times.append(time.perf_counter() - t0)
        doc = json.loads(out.stdout)
    return times, doc


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="~2 MB of logs, one run: a smoke run")
    args = ap.parse_args()
    # The logs are a cache, kept beside the full run's records (the quick set apart).
    logs = results_dir() / ("diagnose_logs_quick" if args.quick else "diagnose_logs")
    t0 = time.perf_counter()
    info = synthesize(logs, 2 if args.quick else TARGET_MB)
    print(f"logs: {info} ({time.perf_counter() - t0:.0f} s to build or find)")
    times, doc = time_diagnose(logs, 1 if args.quick else REPEAT)
    culprits = [(c["rank"], c["cause"]) for c in doc["culprits"]]
    record = {
        **info,
        "seconds": [round(t, 2) for t in times],
        "median_s": round(statistics.median(times), 2),
        "target_s": TARGET_S,
        "culprits": culprits,
        "victims": len(doc["victims"]),
    }
    path = write_record("diagnose_bench", record, quick=args.quick)
    print(f"ae-diagnose --json: median {record['median_s']} s over {times}; culprits {culprits}")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
