"""Goodput of a self-healing run: 2 ranks on CPU, rank 1 SIGKILLed K seconds into every attempt
(as the OOM killer would), `--max_restarts`, against the same run without faults.

Figures per run: wall time (launcher spawn to exit); effective training time (the planned steps
x the median time of a step: the time spent on steps that count) over wall time; restarts and
steps redone (the RESTART lines); and per restart the time from the kill to the new attempt's
first step. Each step is slowed to ~100 ms (`AE_FAULT=slow@train`) so that the steps, not the
startup, fill the run on a small CPU box.

Usage: python -m bench.goodput [--quick]   (writes bench/results/goodput.json)
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import signal
import statistics
import threading
import time
from datetime import datetime
from pathlib import Path

from ae.log_lines import RECORD_PATTERN, RESTART, TRAIN_STEP
from bench.common import launch_run, tiny_shard_set, write_record

DATA = Path("/tmp/ae-bench-data")
STEP_MS = 100  # each optimizer step's simulated compute


def _records(path: Path, fmt) -> list[tuple[float, dict[str, str]]]:
    out = []
    for line in path.read_text(errors="replace").splitlines():
        if (m := RECORD_PATTERN.match(line)) and (found := fmt.parse(m["message"])):
            t = datetime.strptime(m["time"], "%Y-%m-%d %H:%M:%S.%f").timestamp()
            out.append((t, found))
    return out


def _kill_every(logs: Path, seconds: float, kills: int, done: threading.Event) -> list[float]:
    """SIGKILL rank 1 `seconds` after each attempt's first step, `kills` times; returns when."""
    at: list[float] = []
    seen: set[str] = set()
    while len(at) < kills and not done.is_set():
        attempts = sorted(logs.glob("debug_rank1_*.log"))
        new = [p for p in attempts if p.name not in seen]
        if not new or not _records(new[-1], TRAIN_STEP):
            done.wait(0.2)
            continue
        seen.add(new[-1].name)
        if done.wait(seconds):
            break
        ts = new[-1].name.split("_", 2)[2].removesuffix(".log")
        pid = json.loads((logs / f"heartbeat_rank1_{ts}.json").read_text())["pid"]
        with contextlib.suppress(ProcessLookupError):  # that attempt finished first
            os.kill(pid, signal.SIGKILL)
            at.append(time.time())
    return at


def run(spec: str, out: Path, steps: int, kill_after: float | None, kills: int) -> dict:
    args = [f"--train_shards={spec}", f"--val_shards={spec}", "--batch_size=16",
            "--num_workers=1", "--max_epochs=-1", f"--max_steps={steps}", "--debug=true",
            "--log_every_n_train_batches=1", "--checkpointing_period=20", "--max_restarts=10",
            "--warmup_steps=10"]  # fmt: skip
    os.environ["AE_FAULT"] = f"slow@train:ms={STEP_MS}"
    t0 = time.time()
    proc = launch_run(args, out)
    done, kill_times = threading.Event(), []
    killer = None
    if kill_after is not None:
        killer = threading.Thread(
            target=lambda: kill_times.extend(_kill_every(out / "logs", kill_after, kills, done))
        )
        killer.start()
    rc = proc.wait(timeout=1800)
    wall = time.time() - t0
    done.set()
    if killer is not None:
        killer.join()
    if rc != 0:
        raise SystemExit(f"run failed (exit {rc}); see {out}/logs")
    logs = out / "logs"
    attempts = sorted(logs.glob("debug_rank0_*.log"))
    intervals, first_steps = [], []
    for log in attempts:
        times = [t for t, _ in _records(log, TRAIN_STEP)]
        intervals += [b - a for a, b in itertools.pairwise(times)]
        first_steps.append(times[0] if times else None)
    restarts = [r for log in sorted(logs.glob("train_*.log")) for _, r in _records(log, RESTART)]
    step_s = statistics.median(intervals)
    recovery = [
        first - killed
        for killed, first in zip(kill_times, first_steps[1:], strict=False)
        if first is not None
    ]
    return {
        "wall_s": round(wall, 1),
        "step_s": round(step_s, 4),
        "effective_s": round(steps * step_s, 1),
        "goodput": round(steps * step_s / wall, 3),
        "attempts": len(attempts),
        "restarts": len(restarts),
        "steps_redone": sum(int(r["redone"]) for r in restarts),
        "kill_to_first_new_step_s": [round(x, 1) for x in recovery],
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="a short smoke run (one kill)")
    p.add_argument("--kill_after", type=float, help="seconds into each attempt (20; quick: 5)")
    a = p.parse_args()
    steps, kills = (120, 1) if a.quick else (600, 3)
    kill_after = a.kill_after or (5.0 if a.quick else 20.0)
    spec = tiny_shard_set(DATA, 8, 500)
    rows = {}
    for name, after in (("no faults", None), (f"rank 1 killed {kills}x", kill_after)):
        rows[name] = run(spec, DATA / "run-goodput", steps, after, kills)
        print(f"{name}: {rows[name]}")
    record = {"steps": steps, "kill_after_s": kill_after, "runs": rows}
    print(f"wrote {write_record('goodput', record, quick=a.quick)}")


if __name__ == "__main__":
    main()
