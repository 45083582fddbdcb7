"""The Flight Recorder's cost per training step (on vs off), and the time to dump 2,000 entries.

    .venv/bin/python -m bench.flight_recorder [--pairs 5] [--steps 3000] [--quick]

Each job: 2 processes (gloo, CPU) train a tiny DDP model (16 -> 8 -> 16, batch 16) with the
collectives an `ae` step makes: Lightning's stop broadcast, DDP's gradient all-reduce, and the
preemption check (a barrier and an all-reduce). A bare loop with almost no math, so the
recorder's share is as large as it gets (an `ae` step on the same machine is several times
longer). Jobs with the recorder off (`TORCH_FR_BUFFER_SIZE=0`) and on (`ae.forensics.
flight_recorder.enable`, 2,000 entries) alternate, `--pairs` of each, so both see the same load;
the figure is the median of (on - off) / off over the pairs, each job timed after 100 warm-up
steps. After its steps, rank 0 of each `on` job dumps its buffer (full: 2,000 entries) twice
through `flight_recorder.dump`, the code a rank runs: the first dump pays a one-time symbolizer
start, the second is what later dumps cost.

Writes bench/results/flight_recorder.json (`_quick` with --quick).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ae.forensics import flight_recorder
from bench.common import write_record

WARMUP = 100
WORLD = 2


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _job(rank: int, on: bool, steps: int, port: int, logs: str, result: Any) -> None:
    if on:
        flight_recorder.enable(Path(logs), rank, "bench")
    else:
        os.environ["TORCH_FR_BUFFER_SIZE"] = "0"
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD
    )
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(
        torch.nn.Sequential(torch.nn.Linear(16, 8), torch.nn.SiLU(), torch.nn.Linear(8, 16))
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, flag, stop = torch.randn(16, 16), torch.zeros(1, dtype=torch.long), torch.zeros(())
    start = 0.0
    for step in range(WARMUP + steps):
        if step == WARMUP:
            start = time.perf_counter()
        dist.broadcast(flag, 0)  # Lightning's stop broadcast
        loss = torch.nn.functional.mse_loss(model(x), x)
        opt.zero_grad()
        loss.backward()  # DDP's gradient all-reduce
        opt.step()
        dist.barrier()  # the preemption check (reduce_boolean_decision)
        dist.all_reduce(stop)
    step_s = (time.perf_counter() - start) / steps
    dumps = []
    if on and rank == 0:
        for _ in range(2):
            t0 = time.perf_counter()
            path = flight_recorder.dump("bench")
            dumps.append(time.perf_counter() - t0)
        assert path is not None
        entries = len(json.loads(path.read_text())["entries"])
        result.put({"step_s": step_s, "dumps_s": dumps, "entries": entries,
                    "bytes": path.stat().st_size})  # fmt: skip
    elif rank == 0:
        result.put({"step_s": step_s})
    dist.barrier()  # rank 1 waits for rank 0's dumps: a peer gone mid-dump aborts gloo
    dist.destroy_process_group()


def run_job(on: bool, steps: int) -> dict[str, Any]:
    ctx = mp.get_context("spawn")
    result = ctx.Queue()
    with tempfile.TemporaryDirectory() as logs:
        mp.start_processes(
            _job, args=(on, steps, _free_port(), logs, result), nprocs=WORLD, start_method="spawn"
        )
        return result.get(timeout=60)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--pairs", type=int, default=5)
    p.add_argument("--steps", type=int, default=3000)
    p.add_argument("--quick", action="store_true", help="1 pair of 600 steps: a smoke run")
    args = p.parse_args()
    pairs, steps = (1, 600) if args.quick else (args.pairs, args.steps)
    runs = []
    for _ in range(pairs):
        off, on = run_job(False, steps), run_job(True, steps)
        runs.append({"off_step_ms": off["step_s"] * 1e3, "on_step_ms": on["step_s"] * 1e3,
                     "overhead": on["step_s"] / off["step_s"] - 1, "dump": on})  # fmt: skip
    collectives = 4  # per step
    overhead = statistics.median(r["overhead"] for r in runs)
    delta_ms = statistics.median(r["on_step_ms"] - r["off_step_ms"] for r in runs)
    last = runs[-1]["dump"]
    record = {
        "pairs": pairs, "steps": steps, "collectives_per_step": collectives,
        "buffer_entries": flight_recorder.BUFFER_ENTRIES,
        "off_step_ms": statistics.median(r["off_step_ms"] for r in runs),
        "on_step_ms": statistics.median(r["on_step_ms"] for r in runs),
        "overhead": overhead, "overheads": [r["overhead"] for r in runs],
        "us_per_collective": delta_ms * 1e3 / collectives,
        "dump_entries": last["entries"], "dump_bytes": last["bytes"],
        "first_dump_s": statistics.median(r["dump"]["dumps_s"][0] for r in runs),
        "dump_s": statistics.median(r["dump"]["dumps_s"][1] for r in runs),
        "load": os.getloadavg()[0],
    }  # fmt: skip
    path = write_record("flight_recorder", record, quick=args.quick)
    print(json.dumps(record, indent=1))  # a bench reports on stdout
    print(f"written: {path}")


if __name__ == "__main__":
    main()
