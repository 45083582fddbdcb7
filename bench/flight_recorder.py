"""The Flight Recorder's cost per training step (on vs off), and the time to dump 2,000 entries.

    .venv/bin/python -m bench.flight_recorder [--pairs 5] [--steps 3000] [--quick]

Each job: 2 processes (gloo, CPU) train a tiny DDP model (16 -> 8 -> 16, batch 16) with the
collectives an `ae` step makes: Lightning's stop broadcast, DDP's gradient all-reduce, and the
preemption check (a barrier and an all-reduce). A bare loop with almost no math and none of
Lightning's own work per step, so the recorder's share is larger than in an `ae` step. Jobs
with the recorder off (`TORCH_FR_BUFFER_SIZE=0`) and on (`flight_recorder.enable`, 2,000
entries) alternate, `--pairs` of each, so both see the same load;
the figures are the medians of (on - off) / off over the pairs, in wall time and in the CPU time
of rank 0 (all its threads), each job timed after 100 warm-up steps. On a shared machine both
drown in the noise; so also, per pair, one process (world size 1) times 4 x steps all-reduces
of one number issued 40 frames deep (a Lightning step's depth) with the recorder on and off:
the recording cost per collective in CPU time, and its share of the bare step. After its
steps, rank 0 of each `on` job dumps its buffer (full: 2,000 entries) twice through
`flight_recorder.dump`, the code a rank runs: the first dump pays a one-time symbolizer start,
the second is what later dumps cost.

`--quick` (the suite's smoke run): one pair of 100 steps after 10 warm-up steps, the processes
spawned as in a full run (forked from this one when it imported torch, a job hung in CI
twice); rank 0 of each job times the per-collective micro-run after its job (a world of 1 made
after the job's group is gone), so the quick mode starts 4 processes, not 6 (each ~3 s of CPU,
importing torch mostly). The ranks meet through a file in the job's temporary folder, not a
free port picked beforehand (another process could take it first), and a job not done in
JOIN_TIMEOUT_S is stopped and fails naming itself (the quick mode once hung in CI until the
test's 900 s).

Writes bench/results/flight_recorder.json (`_quick` with --quick).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import statistics
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

from bench.common import write_record

# torch (and ae.forensics.flight_recorder, which imports it) only in the jobs' processes, which
# import it themselves: this one starts them and reads their results (~2.5 s of CPU less)

WARMUP = 100
WORLD = 2
JOIN_TIMEOUT_S = 180.0  # a job of a full run takes ~30 s
# (steps, warm-up steps, start method) of --quick
# Spawned, not forked, in the quick mode too: a fork of this process (then torch imported, threads
# started) hung one job in CI twice, at 4 s of CPU (a child deadlocked at birth)
QUICK = (100, 10, "spawn")


def _job(rank: int, on: bool, steps: int, warmup: int, logs: str, result: Any,
         micro: int = 0) -> None:  # fmt: skip
    """One rank of a job; rank 0 puts its figures in `result`. With `micro` (--quick), rank 0
    then also runs `_micro`'s timing of `micro` all-reduces and puts it next."""
    import torch
    import torch.distributed as dist

    from ae.forensics import flight_recorder

    if on:
        flight_recorder.enable(Path(logs), rank, "bench")
    else:
        os.environ["TORCH_FR_BUFFER_SIZE"] = "0"
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{logs}/store", rank=rank, world_size=WORLD,
        timeout=timedelta(seconds=120),
    )  # fmt: skip
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(
        torch.nn.Sequential(torch.nn.Linear(16, 8), torch.nn.SiLU(), torch.nn.Linear(8, 16))
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, flag, stop = torch.randn(16, 16), torch.zeros(1, dtype=torch.long), torch.zeros(())
    start, cpu = 0.0, 0.0
    for step in range(warmup + steps):
        if step == warmup:
            start, cpu = time.perf_counter(), time.process_time()
        dist.broadcast(flag, 0)  # Lightning's stop broadcast
        loss = torch.nn.functional.mse_loss(model(x), x)
        opt.zero_grad()
        loss.backward()  # DDP's gradient all-reduce
        opt.step()
        dist.barrier()  # the preemption check (reduce_boolean_decision)
        dist.all_reduce(stop)
    step_s = (time.perf_counter() - start) / steps
    cpu_s = (time.process_time() - cpu) / steps  # this process, all its threads (gloo's too)
    dumps = []
    if on and rank == 0:
        for _ in range(2):
            t0 = time.perf_counter()
            path = flight_recorder.dump("bench")
            dumps.append(time.perf_counter() - t0)
        assert path is not None
        entries = len(json.loads(path.read_text())["entries"])
        result.put({"step_s": step_s, "cpu_s": cpu_s, "dumps_s": dumps, "entries": entries,
                    "bytes": path.stat().st_size,
                    "buffer_entries": flight_recorder.BUFFER_ENTRIES})  # fmt: skip
    elif rank == 0:
        result.put({"step_s": step_s, "cpu_s": cpu_s})
    dist.barrier()  # rank 1 waits for rank 0's dumps: a peer gone mid-dump aborts gloo
    dist.destroy_process_group()
    if micro and rank == 0:  # the recorder stays as this process set it (on or off)
        result.put(_micro_timing(micro, warmup, f"{logs}/micro"))


def _micro(_index: int, on: bool, n: int, warmup: int, logs: str, result: Any) -> None:
    """One process, world size 1: `n` all-reduces of one number issued from 40 frames deep
    (a Lightning step's depth); CPU time per collective."""
    import torch

    from ae.forensics import flight_recorder

    if on:
        flight_recorder.enable(Path(logs), 0, "bench")
    else:
        os.environ["TORCH_FR_BUFFER_SIZE"] = "0"
    torch.set_num_threads(1)
    result.put(_micro_timing(n, warmup, logs))


def _micro_timing(n: int, warmup: int, logs: str) -> float:
    """`_micro`'s timing in this process, the recorder already on or off."""
    import torch
    import torch.distributed as dist

    Path(logs).mkdir(exist_ok=True)
    dist.init_process_group("gloo", init_method=f"file://{logs}/store", rank=0, world_size=1)
    x = torch.zeros(1)

    def deep(level: int) -> float:
        if level:
            return deep(level - 1)
        for _ in range(warmup):
            dist.all_reduce(x)
        t0 = time.process_time()
        for _ in range(n):
            dist.all_reduce(x)
        return (time.process_time() - t0) / n

    timing = deep(40)
    dist.destroy_process_group()
    return timing


def _run(fn: Any, nprocs: int, on: bool, n: int, warmup: int, start: str, *more: Any) -> Any:
    """`fn` in `nprocs` processes; what rank 0 put in the result queue (a list of the two
    things it put, given a micro-run count in `more`). Processes not done after JOIN_TIMEOUT_S
    are killed, and the bench fails saying which job hung; so does a process that failed (its
    traceback is on stderr), the others killed."""
    ctx = multiprocessing.get_context(start)
    result = ctx.Queue()
    with tempfile.TemporaryDirectory() as logs:
        args = (on, n, warmup, logs, result, *more)
        procs = [ctx.Process(target=fn, args=(i, *args)) for i in range(nprocs)]
        for proc in procs:
            proc.start()
        deadline = time.monotonic() + JOIN_TIMEOUT_S
        while (codes := [proc.exitcode for proc in procs]).count(0) < nprocs:
            failed = any(code not in (0, None) for code in codes)
            if failed or time.monotonic() > deadline:
                for proc in procs:
                    proc.kill()
                    proc.join()
                how = f"failed (exit codes {codes})" if failed else (
                    f"not done in {JOIN_TIMEOUT_S:.0f}s: hung")  # fmt: skip
                error = RuntimeError if failed else TimeoutError
                raise error(f"{fn.__name__} (recorder on: {on}) {how}")
            next(proc for proc in procs if proc.exitcode is None).join(timeout=1.0)
        if more and more[0]:
            return [result.get(timeout=60), result.get(timeout=60)]
        return result.get(timeout=60)


def run_micro(on: bool, n: int, warmup: int = WARMUP, start: str = "spawn") -> float:
    return float(_run(_micro, 1, on, n, warmup, start))


def run_job(on: bool, steps: int, warmup: int = WARMUP, start: str = "spawn") -> dict[str, Any]:
    return _run(_job, WORLD, on, steps, warmup, start)


def run_job_and_micro(
    on: bool, steps: int, n: int, warmup: int, start: str
) -> tuple[dict[str, Any], float]:
    """--quick: a job whose rank 0 then times `n` all-reduces (run_job, then run_micro)."""
    job, micro = _run(_job, WORLD, on, steps, warmup, start, n)
    return job, float(micro)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--pairs", type=int, default=5)
    p.add_argument("--steps", type=int, default=3000)
    p.add_argument("--quick", action="store_true", help="1 pair of 100 steps: a smoke run")
    args = p.parse_args()
    pairs, steps, warmup, start = (
        (1, *QUICK) if args.quick else (args.pairs, args.steps, WARMUP, "spawn")
    )
    runs, micro = [], []
    for _ in range(pairs):
        n = steps * 4
        if args.quick:  # each job's rank 0 times the micro-run after it: 4 processes, not 6
            (off, micro_off), (on, micro_on) = (
                run_job_and_micro(False, steps, n, warmup, start),
                run_job_and_micro(True, steps, n, warmup, start),
            )
        else:
            off, on = run_job(False, steps, warmup, start), run_job(True, steps, warmup, start)
        runs.append({"off_step_ms": off["step_s"] * 1e3, "on_step_ms": on["step_s"] * 1e3,
                     "overhead": on["step_s"] / off["step_s"] - 1,
                     "off_cpu_ms": off["cpu_s"] * 1e3, "on_cpu_ms": on["cpu_s"] * 1e3,
                     "cpu_overhead": on["cpu_s"] / off["cpu_s"] - 1, "dump": on})  # fmt: skip
        if not args.quick:
            micro_on = run_micro(True, n, warmup, start)
            micro_off = run_micro(False, n, warmup, start)
        micro.append(micro_on - micro_off)
    collectives = 4  # per step
    overhead = statistics.median(r["overhead"] for r in runs)
    us_per_collective = statistics.median(micro) * 1e6
    off_step_ms = statistics.median(r["off_step_ms"] for r in runs)
    last = runs[-1]["dump"]
    record = {
        "pairs": pairs, "steps": steps, "collectives_per_step": collectives,
        "buffer_entries": runs[-1]["dump"]["buffer_entries"],
        "off_step_ms": off_step_ms,
        "on_step_ms": statistics.median(r["on_step_ms"] for r in runs),
        "overhead": overhead, "overheads": [r["overhead"] for r in runs],
        "cpu_overhead": statistics.median(r["cpu_overhead"] for r in runs),
        "cpu_overheads": [r["cpu_overhead"] for r in runs],
        "us_per_collective": us_per_collective, "us_per_collective_runs": [m * 1e6 for m in micro],
        "share_of_bare_step": us_per_collective * collectives / (off_step_ms * 1e3),
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
