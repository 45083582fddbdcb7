"""Trainer overhead: optimizer steps/s of `ae` (Lightning + our callbacks + logging), of a bare
Lightning Trainer (no ae callbacks; the two loggers ae writes by default) and of a hand-written
PyTorch loop, same model, same tensors, 1 process and 2-process DDP (gloo on CPU), all measured
in one run.

The three sides train the `AutoEncoder` on the same pre-made batches (no data pipeline: that has
its own bench), with the same AdamW + warmup/cosine schedule and gradient clipping. The hand
loop is what a trainer would cost if it were free; bare Lightning / hand loop is what Lightning
itself costs, ae / bare Lightning what ae adds on top (callbacks, forensics, its own logging).

The ae side gets what a rank gets (`ae/rank/train.py`): logging configured, `build_trainer` with
every callback, and a `ShardDataModule` over a small shard set (its validation split is what
sampling reads); only its train loader is replaced by the pre-made batches. Each side's rate is
timed inside the loop, from the start of step 21 to the end of the last step but one, so process
start, setup, the final checkpoint of ae's last step, the epoch-end validation and teardown are
left out alike: what is left is the cost of a step.

The ae side is a rank as `ae/rank/train.py` starts it, the watchdog thread and the Flight
Recorder included. `--variants` adds sides that are ae with one piece taken out (or, for
`old_stop_check` and `with_ema`, put in): each is timed in the same interleaved rounds, and its
cost per step is 1 / rate(ae) - 1 / rate(ae without it) (docs/BENCHMARKS.md has the table).

The figures are medians over `--repeats` rounds. In a round every side's processes run at once,
in lockstep (`bench/lockstep.py`): each side runs SLICE optimizer steps of its window while the
others wait, blocked, so that the drift of a shared machine's speed (this VM's rounds of one
side swung up to 2x, run one after another) falls on every side alike. The ratios are the
medians of the rounds' own ratios (each a pair measured in the same seconds); the rates, the
medians of each side's. Then each side runs once more, alone, to count its Python function calls
a step in the same window (`calls_per_step`): a figure no load moves.

`--quick`, a smoke run whose figures mean nothing, runs 40 steps in one round (19 timed after the
20 warm-up steps: two turns of each side) and counts the calls in it; its sides' processes are
forked from the bench's (which imports what they import first), the 2 ranks of a side with the
environment torchrun gives its ranks: the same workers, without the ~6 s of CPU that an
interpreter importing torch and Lightning costs each of 12 processes.

Usage: python -m bench.trainer_overhead [--steps 600] [--repeats 5] [--worlds 1,2]
           [--variants no_vote,old_stop_check,...|all] [--quick]
    (writes bench/results/trainer_overhead.json; --quick: trainer_overhead_quick.json)
The non-finite check's cost (issue 36): `--variants no_nonfinite_guard`.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

from bench.common import write_record
from bench.lockstep import Command, Forked, run_in_turns
from bench.trainer_sides import (
    COUNT_CALLS,
    SIDES,
    preload,
    run_ae,
    run_lightning,
    run_manual,
    timed_steps,
)
from bench.trainer_variants import VARIANTS


def _worker(args: argparse.Namespace) -> None:
    world = int(os.environ.get("WORLD_SIZE", 1))
    if args.side == "manual":
        if world > 1:
            dist.init_process_group("gloo")
        rate = run_manual(args.steps, world)
    elif args.side == "lightning":
        rate = run_lightning(args.steps, world, Path(args.out).parent / "run")
    else:
        variant = args.side.removeprefix("ae:") if args.side != "ae" else None
        rate = run_ae(args.steps, world, Path(args.out).parent / "run", variant)
    if int(os.environ.get("RANK", 0)) == 0:
        Path(args.out).write_text(json.dumps(rate))
    if dist.is_initialized():
        # Both ranks done with every collective before either tears its group down (a rank that
        # destroyed gloo under a peer still in it once aborted the peer: SIGABRT).
        dist.barrier()
        dist.destroy_process_group()


def _command(side: str, world: int, steps: int, out: Path) -> list[str]:
    worker = ["-m", "bench.trainer_overhead", "--worker", f"--side={side}", f"--steps={steps}",
              f"--out={out}"]  # fmt: skip
    # One process needs no torchrun (its agent alone is a second interpreter with torch).
    launch = ["-m", "torch.distributed.run", f"--nproc_per_node={world}", "--standalone"]
    return [sys.executable, *(launch if world > 1 else []), *worker]


def _forked(side: str, world: int, steps: int, out: Path) -> Callable[[], int]:
    """--quick's side: the worker `_command` starts, run in this process's forks; 2 processes as
    torchrun's agent would start them (its ranks' environment, one run TS for both)."""
    args = argparse.Namespace(side=side, steps=steps, out=str(out))

    def rank() -> int:
        _worker(args)
        return 0

    def agent() -> int:
        if world == 1:
            return rank()
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        env = dict(
            os.environ,
            WORLD_SIZE=str(world),
            LOCAL_WORLD_SIZE=str(world),
            GROUP_RANK="0",
            GROUP_WORLD_SIZE="1",
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            TORCHELASTIC_RUN_ID="bench",
            AE_RUN_TS=time.strftime("%Y%m%d_%H%M%S"),
        )
        ranks = [
            Forked(rank, {**env, "RANK": str(r), "LOCAL_RANK": str(r)}, sys.stderr)
            for r in range(world)
        ]
        while None in (codes := [r.poll() for r in ranks]):
            if any(codes):  # as torchrun's agent: a rank failed, the others (waiting for it) go
                for r in ranks:
                    r.kill()
                    r.wait()
                return 1
            time.sleep(0.1)
        return 1 if any(codes) else 0

    return agent


def _env(count_calls: bool) -> dict[str, str]:
    # One thread per process: the math of a 256 x 64 batch gains nothing from a second one on a
    # shared machine, and the CPU time then counts the step's work, not idle spinning.
    return {**os.environ, "OMP_NUM_THREADS": "1", **({COUNT_CALLS: "1"} if count_calls else {})}


def _round(sides: list[str], world: int, steps: int, quick: bool) -> dict[str, dict]:
    """One round: every side at once, taking turns (bench/lockstep.py); each side's rates. Quick:
    the sides forked, and their Python calls counted."""
    with tempfile.TemporaryDirectory() as tmp:
        outs = {side: Path(tmp) / f"{i}" / "result.json" for i, side in enumerate(sides)}
        for out in outs.values():
            out.parent.mkdir()
        start = _forked if quick else _command
        commands: dict[str, tuple[Command, int]] = {
            side: (start(side, world, steps, outs[side]), world) for side in sides
        }
        for attempt in (1, 2):  # one more try: a crash on a loaded machine costs the whole run
            done = run_in_turns(commands, _env(quick))
            if all(r.returncode == 0 for r in done.values()):
                return {side: json.loads(outs[side].read_text()) for side in sides}
            for side, r in done.items():
                print(f"{side} side, {world} process(es), exit {r.returncode} (try {attempt} of "
                      f"2):\n{r.stderr[-3000:]}", flush=True)  # fmt: skip
        sys.exit(f"a round of {world} process(es) failed twice")


def _count_calls(side: str, world: int, steps: int) -> float:
    """Python calls a step of one side, run alone (the profiler slows every call)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        for attempt in (1, 2):
            done = subprocess.run(_command(side, world, steps, out), env=_env(True),
                                  capture_output=True, text=True, timeout=300)  # fmt: skip
            if done.returncode == 0:
                return json.loads(out.read_text())["calls"]
            print(f"{side} side, {world} process(es) failed (try {attempt} of 2):\n"
                  f"{done.stderr[-4000:]}", flush=True)  # fmt: skip
        sys.exit(f"{side} side, {world} process(es) failed twice")


def _paired(rates: dict[str, list[dict[str, float]]], clock: str, f) -> float:
    """The median over the rounds of f(this round's rates): a figure of sides timed side by side."""
    rounds = range(len(rates["ae"]))
    return statistics.median(
        f({side: runs[i][clock] for side, runs in rates.items()}) for i in rounds
    )


def _row(world: int, rates: dict[str, list[dict[str, float]]]) -> dict:
    """The median rate of each side, wall and CPU; the three ratios of each and, per variant, its
    rate against ae's and its cost per step (us; negative: the variant is the slower), each the
    median of the rounds' own figures."""
    row: dict = {"processes": world, "all": rates}
    for clock in ("wall", "cpu", "thread_cpu"):
        row[clock] = {
            **{side: statistics.median(r[clock] for r in runs) for side, runs in rates.items()},
            "ae_vs_manual": _paired(rates, clock, lambda r: r["ae"] / r["manual"]),
            "lightning_vs_manual": _paired(rates, clock, lambda r: r["lightning"] / r["manual"]),
            "ae_vs_lightning": _paired(rates, clock, lambda r: r["ae"] / r["lightning"]),
            "variants": {
                side.removeprefix("ae:"): {
                    "vs_ae": _paired(rates, clock, lambda r, s=side: r[s] / r["ae"]),
                    "cost_us_per_step": _paired(
                        rates, clock, lambda r, s=side: 1e6 * (1 / r["ae"] - 1 / r[s])
                    ),
                }
                for side in rates
                if side.startswith("ae:")
            },
        }
    return row


def _report(world: int, row: dict) -> None:
    for clock, unit in (
        ("wall", "steps/s"),
        ("cpu", "steps per CPU s"),
        ("thread_cpu", "steps per CPU s of the training thread"),
    ):
        r = row[clock]
        print(
            f"{world} process(es), {unit} (medians): hand loop {r['manual']:.1f}, bare"
            f" Lightning {r['lightning']:.1f}, ae {r['ae']:.1f}; the rounds' ratios: ae / hand"
            f" loop {r['ae_vs_manual']:.3f}x, bare Lightning / hand loop"
            f" {r['lightning_vs_manual']:.3f}x, ae / bare Lightning {r['ae_vs_lightning']:.3f}x",
            flush=True,
        )
        for name, v in r["variants"].items():
            print(f"    ae {name}: {v['vs_ae']:.3f}x ae, {v['cost_us_per_step']:+.0f} us a step")
    calls = row["calls_per_step"]
    more = {side: n - calls["ae"] for side, n in calls.items() if side.startswith("ae:")}
    extra = calls["ae"] - calls["lightning"]
    print(
        f"{world} process(es), Python calls a step (rank 0): hand loop {calls['manual']:.0f}, bare"
        f" Lightning {calls['lightning']:.0f}, ae {calls['ae']:.0f} (+{extra:.0f})"
        + "".join(f"; ae {side[3:]} {n:+.0f}" for side, n in more.items()),
        flush=True,
    )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--repeats", type=int, default=5, help="interleaved rounds; medians kept")
    ap.add_argument("--worlds", default="1,2", help="process counts, comma-separated")
    ap.add_argument("--variants", default="", help=f"'all' or some of: {', '.join(VARIANTS)}")
    ap.add_argument(
        "--quick", action="store_true", help="40 steps, one round, calls counted in it: a smoke run"
    )
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--side")
    ap.add_argument("--out")
    args = ap.parse_args()
    if args.worker:
        _worker(args)
        return
    # quick: the fewest steps that pass the turn within the window (at step 30) and end it
    steps, repeats = (40, 1) if args.quick else (args.steps, args.repeats)
    variants = (
        list(VARIANTS) if args.variants == "all" else [v for v in args.variants.split(",") if v]
    )
    if unknown := set(variants) - set(VARIANTS):
        sys.exit(f"unknown variants {sorted(unknown)}; known: {', '.join(VARIANTS)}")
    sides = [*SIDES, *(f"ae:{v}" for v in variants)]
    if args.quick:  # before the forks: each side's process inherits these
        preload()
        torch.set_num_threads(1)  # what _env's OMP_NUM_THREADS gives a new interpreter
    rows = []
    for world in map(int, args.worlds.split(",")):
        rates: dict[str, list[dict[str, float]]] = {side: [] for side in sides}
        for _ in range(repeats):
            for side, rate in _round(sides, world, steps, quick=args.quick).items():
                rates[side].append(rate)
        row = _row(world, rates)
        # Python calls a step, rank 0's, counted in a run of their own per side (the profiler
        # slows every call). --quick, a smoke run of every path whose figures mean nothing,
        # counts them in its one timed round: half the processes.
        row["calls_per_step"] = {
            side: rates[side][0]["calls"] if args.quick else _count_calls(side, world, steps)
            for side in sides
        }
        rows.append(row)
        _report(world, row)
    load = os.getloadavg()
    record = {"steps": steps, "timed_steps": timed_steps(steps), "repeats": repeats,
              "variants": {v: VARIANTS[v] for v in variants}, "load_at_end": load[:2],
              "rows": rows}  # fmt: skip
    print(f"load average at the end: {load[0]:.1f} (1 min), {load[1]:.1f} (5 min)")
    print(f"wrote {write_record('trainer_overhead', record, quick=args.quick)}")


if __name__ == "__main__":
    main()
