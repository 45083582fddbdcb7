"""Stragglers on a healthy run: no false positive over minutes, and what the measurement costs.

    .venv/bin/python -m bench.straggler_soak [--seconds 200] [--window 60]
    .venv/bin/python -m bench.straggler_soak --quick   # 5 s of soak, fewer timing rounds

soak: a healthy 2-rank CPU run through the real launcher (tiny MLP, batch 16, 2 dataloader
workers per rank, the default --straggler_factor), trained for `--seconds` after its first step,
then killed. Asserts nothing; reports the STRAGGLER lines in all its logs (a false positive is
any), the highest score any rank reached (the heartbeats are read once a second and scored with
the detector's own rules, `ae.stragglers.scores`), and the per-step figures of its heartbeats.

overhead: the measurement's cost per optimizer step, timed in this process on the real objects,
divided by the soak run's step time (the baseline, from the same run):
- the training thread: the data-wait clock around the loader's `next()` (two clock reads and
  `StepTimes.fetched`), `StepTimes.batch_end`, and the note of the all-reduce's start in DDP's
  comm hook against the same hook without it, on a 1-process gloo group (blocks of 200
  backward passes alternate between the two models; the fastest block of each, the one least
  disturbed by other processes, is compared: on this shared machine a median of block
  differences swung from 30 to 430 us);
- each dataloader worker: `SlotMeter.batch`, once per batch (one batch per step here);
- the watchdog thread, once per heartbeat (every 5 s at the defaults): the heartbeat's `timing`
  and `data_workers`, and the detector reading and scoring both ranks' heartbeat files; spread
  over the steps of one heartbeat interval.
Writes bench/results/straggler_soak.json (`--quick`: straggler_soak_quick.json).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from ae.data.stream.worker_stats import WorkerStats
from ae.forensics import step_times as st
from ae.forensics.heartbeat import heartbeat_record
from ae.forensics.process_stats import RssReader
from ae.forensics.progress import Progress
from ae.forensics.step_times import StepTimes, gradients_ready
from ae.forensics.stragglers import Stragglers, read_timings
from ae.log_lines import HEARTBEAT_FILE, STRAGGLER, STRAGGLER_RESOLVED
from ae.stragglers import scores
from bench.common import launch_run, tiny_shard_set, write_record
from logging_cfg import RankContext

DATA = Path("/tmp/ae-bench-data")
HEARTBEAT_S = 5.0  # the watchdog's heartbeat period at the default --stall_timeout


def soak(seconds: float, window: float, out: Path) -> dict[str, Any]:
    spec, val = tiny_shard_set(DATA, 8, 4000, dim=16), tiny_shard_set(DATA, 1, 320, dim=16)
    proc = launch_run(
        [f"--train_shards={spec}", f"--val_shards={val}", "--max_epochs=100", "--batch_size=16",
         "--num_workers=2", "--hidden_dim=8", "--latent_dim=4", "--checkpointing_period=0",
         f"--straggler_window={window}"],
        out,
    )  # fmt: skip
    logs = out / "logs"
    max_score = {0: 0.0, 1: 0.0}
    started = None
    samples: list[dict[str, Any]] = []
    try:
        while started is None or time.time() - started < seconds:
            assert proc.poll() is None, f"the run ended early (exit {proc.returncode}): {logs}"
            time.sleep(1.0)
            heartbeats = sorted(logs.glob(HEARTBEAT_FILE.format(rank="*", ts="*")))
            if len(heartbeats) < 2:
                continue
            ts = heartbeats[0].stem.split("_", 2)[2]
            timings = read_timings(logs, ts, time.time(), max_age_s=15.0)
            for rank, score in scores(timings).items():
                started = started or time.time()
                max_score[rank] = max(max_score[rank], score)
            samples.extend({"rank": r, **t.recent.__dict__} for r, t in timings.items() if t.recent)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    lines = [
        line.split("] ", 1)[1]
        for path in sorted(logs.glob("*.log"))
        for line in path.read_text(errors="replace").splitlines()
        if "] STRAGGLER " in line
    ]
    named = [m for m in lines if STRAGGLER.parse(m) or STRAGGLER_RESOLVED.parse(m)]
    step_ms = statistics.median(s["step_ms"] for s in samples)
    return {
        "seconds": seconds,
        "straggler_window": window,
        "straggler_lines": len(named),
        "lines": named[:10],
        "max_score": {str(r): round(s, 3) for r, s in max_score.items()},
        "median_step_ms": round(step_ms, 3),
        "median_own_ms": round(statistics.median(s["own_ms"] for s in samples), 3),
        "median_data_ms": round(statistics.median(s["data_ms"] for s in samples), 3),
        "median_sync_ms": round(statistics.median(s["sync_ms"] for s in samples), 3),
    }


def per_call_us(fn: Callable[[], Any], n: int) -> float:
    """Median over 5 rounds of the time per call of `fn`, in microseconds."""
    rounds = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        rounds.append((time.perf_counter() - t0) / n * 1e6)
    return statistics.median(rounds)


def clock_us(n: int) -> dict[str, float]:
    """The training thread's clock per step, and a worker's meter per batch."""
    times = StepTimes()

    def one_step() -> None:
        started = time.perf_counter()  # ResumableLoader, around next()
        times.fetched(started, time.perf_counter())
        times.collective(time.perf_counter(), time.perf_counter())  # in the hook
        times.batch_end(time.perf_counter(), 1)

    meter = WorkerStats.create(2).meter(0)
    return {"step_clock": per_call_us(one_step, n), "worker_meter": per_call_us(
        lambda: meter.batch(0.001), n)}  # fmt: skip


def hook_us(tmp: Path, blocks: int = 20, per_block: int = 200) -> float:
    """Extra time per backward pass of noting the all-reduce's start (`gradients_ready`, what ae's
    comm hook calls for the step clock) over the same comm hook without it."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    times = StepTimes()
    saved, st.step_times = st.step_times, times
    dist.init_process_group("gloo", init_method=f"file://{tmp / 'store'}", rank=0, world_size=1)

    def timed_hook(state, bucket):  # unannotated: DDP checks a hook's annotations' types
        gradients_ready()
        return allreduce_hook(state, bucket)

    try:
        torch.manual_seed(0)
        plain = DistributedDataParallel(torch.nn.Sequential(torch.nn.Linear(16, 8),
                                                            torch.nn.Linear(8, 16)))  # fmt: skip
        timed = DistributedDataParallel(torch.nn.Sequential(torch.nn.Linear(16, 8),
                                                            torch.nn.Linear(8, 16)))  # fmt: skip
        plain.register_comm_hook(None, allreduce_hook)
        timed.register_comm_hook(None, timed_hook)
        x = torch.randn(16, 16)

        def block(model: DistributedDataParallel) -> float:
            t0 = time.perf_counter()
            for _ in range(per_block):
                model(x).sum().backward()
                times.backward_done(time.perf_counter())
                times.batch_end(time.perf_counter(), 0)  # drop the collected collectives
            return (time.perf_counter() - t0) / per_block * 1e6

        block(plain), block(timed)  # warm-up
        plain_us, timed_us = [], []
        for i in range(blocks):  # ABBA order; the fastest block of each: the least disturbed
            for model, out in ((plain, plain_us), (timed, timed_us))[:: 1 if i % 2 else -1]:
                out.append(block(model))
        return min(timed_us) - min(plain_us)
    finally:
        dist.destroy_process_group()
        st.step_times = saved


def heartbeat_us(tmp: Path, n: int) -> float:
    """The watchdog thread's straggler work per heartbeat on rank 0 of 2: the timing fields of
    its heartbeat, and the detector reading and scoring both heartbeat files."""
    times = StepTimes()
    for i in range(200):
        times.fetched(i * 0.01, i * 0.01 + 0.001)
        times.batch_end(i * 0.01 + 0.008, 1)
    stats = WorkerStats.create(2)
    for w in range(2):
        stats.meter(w).batch(0.001)
    times.data_workers = lambda: stats.rows([f"/d/shard-{i:06d}.tar" for i in range(8)])
    ctx = RankContext(rank=0, world_size=2, local_rank=0)
    for rank in range(2):
        record = heartbeat_record(RankContext(rank=rank, world_size=2, local_rank=rank),
                                  Progress(), RssReader(), stalled=False, times=times)  # fmt: skip
        record["time"] = time.time() + 3600  # fresh for the whole measurement
        (tmp / HEARTBEAT_FILE.format(rank=rank, ts="TS")).write_text(json.dumps(record))
    detector = Stragglers(1.3, 60.0, tmp, "TS", ctx, max_age_s=15.0)
    return per_call_us(lambda: (times.heartbeat(), detector.check()), n)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seconds", type=float, default=200.0)
    ap.add_argument("--window", type=float, default=60.0, help="--straggler_window of the run")
    ap.add_argument("--quick", action="store_true", help="5 s of soak, fewer rounds: a smoke run")
    args = ap.parse_args()
    # (calls per round of the clocks, of the heartbeat; hook blocks, backward passes per block)
    n_clock, n_beat, blocks, per_block = (2000, 20, 4, 20) if args.quick else (20000, 200, 20, 200)
    if args.quick:
        args.seconds = 5.0
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory() as tmp:
        run = soak(args.seconds, args.window, Path(tmp) / "run")
        costs = clock_us(n_clock) | {"allreduce_hook": hook_us(Path(tmp), blocks, per_block)}
        costs["heartbeat"] = heartbeat_us(Path(tmp), n_beat)
    step_us = 1000 * run["median_step_ms"]
    steps_per_heartbeat = HEARTBEAT_S * 1e6 / step_us
    per_step = {
        "step_clock": costs["step_clock"],
        "allreduce_hook": costs["allreduce_hook"],
        "worker_meter": costs["worker_meter"],
        "heartbeat": costs["heartbeat"] / steps_per_heartbeat,
    }
    total = sum(per_step.values())
    record = {
        "soak": run,
        "cost_us": {k: round(v, 2) for k, v in costs.items()},
        "per_step_us": {k: round(v, 3) for k, v in per_step.items()},
        "overhead_pct": round(100 * total / step_us, 3),
        "loadavg_before": load_before,
        "loadavg_after": os.getloadavg(),
    }
    path = write_record("straggler_soak", record, quick=args.quick)
    print(f"soak {args.seconds:.0f} s, 2 ranks, --straggler_window={args.window:g}: "
          f"{run['straggler_lines']} STRAGGLER lines; top scores {run['max_score']}")  # fmt: skip
    print(f"step {run['median_step_ms']} ms (own {run['median_own_ms']}, data "
          f"{run['median_data_ms']}, sync {run['median_sync_ms']})")  # fmt: skip
    for k, v in per_step.items():
        print(f"  {k:15s} {v:8.2f} us per step  ({100 * v / step_us:.3f}% of the step)")
    print(f"overhead {record['overhead_pct']}% of the step time; load {load_before} -> "
          f"{record['loadavg_after']}; {path}")  # fmt: skip


if __name__ == "__main__":
    main()
