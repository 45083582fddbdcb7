"""Goodput of a self-healing job on two hosts (issue 38): two network-namespace hosts (the
multi-node tests' harness, bench/two_hosts.py), one rank each, `--max_restarts` on
torchrun's elastic agent; the rank on node1 SIGKILLed (as the OOM killer would) K seconds after
each attempt's first step, with and without `--checkpoint_minutes`, against the same job without
faults, measured in the same run of this bench. `--quick` (the suite's smoke run) runs one job:
node1's rank killed once at a step count (`AE_FAULT=kill@train:step=N:attempt=0` in node1's
environment: the rank SIGKILLs itself there, so the kill never lands in a finished attempt's
teardown), with `--checkpoint_minutes`, and no fault-free job to compare with.

Every figure comes from `ae-diagnose --json`'s `goodput` (one source): the effective-training
share and the breakdown of the wall time the logs span (docs/DIAGNOSE.md, `--goodput`); the
ratios are each run's against the fault-free one. Each step is slowed to ~100 ms
(`AE_FAULT=slow@train`), so that steps rather than startup fill a run on a small CPU box. Where
`ip netns` cannot be used (not root, a container), it says why, writes a record marked
`skipped`, and exits 0.

Usage: python -m bench.goodput [--quick] [--kill_after S]   (writes bench/results/goodput.json)
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from ae.log_lines import FAULT_INJECTED, RESTART
from bench.common import one_thread_per_process, tiny_shard_set, write_record
from bench.two_hosts import TwoHosts, available, cleanup_stale

DATA = Path("/tmp/ae-bench-data")
ROOT = Path(__file__).resolve().parent.parent
STEP_MS = 100  # each optimizer step's simulated compute
MASTER = "192.168.77.1"  # host 0's address in TwoHosts
# --quick: node1's rank is killed at this step of the first attempt (a save at step 20 before
# it: 5 steps redone), and the restart trains on to QUICK_STEPS
QUICK_STEPS, QUICK_KILL_STEP = 40, 25


def _node_env(node: int, port: int, kill_step: int | None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.endswith("_SOCKET_IFNAME")}
    env.pop("AE_RUN_TS", None)
    fault = f"slow@train:ms={STEP_MS}"
    if node == 1 and kill_step is not None:  # the first attempt's rank only: the restart runs on
        fault += f",kill@train:step={kill_step}:attempt=0"
    return {**env, "NNODES": "2", "NODE_RANK": str(node), "MASTER_ADDR": MASTER,
            "MASTER_PORT": str(port), "AE_CACHE_DIR": str(DATA / "cache"),
            "AE_FAULT": fault}  # fmt: skip


def _node1_rank(logs: Path, seen: set[str]) -> tuple[str, int] | None:
    """The newest attempt not yet struck whose rank on node1 has trained: (run TS, its pid)."""
    for beat in sorted(logs.glob("heartbeat_rank*_*.json"), reverse=True):
        ts = beat.name.split("_", 2)[2].removesuffix(".json")
        if ts in seen:
            continue
        with contextlib.suppress(OSError, ValueError):
            found = json.loads(beat.read_text())
            if found.get("host") == "node1" and found.get("step", 0) > 0:
                return ts, found["pid"]
    return None


def _training(logs: Path, ts: str) -> bool:
    """Whether node1's rank of attempt `ts` still trains (its heartbeat says `running`)."""
    for beat in logs.glob(f"heartbeat_rank*_{ts}.json"):
        with contextlib.suppress(OSError, ValueError):
            found = json.loads(beat.read_text())
            if found.get("host") == "node1":
                return found.get("state") == "running"
    return False


def _kill_every(logs: Path, seconds: float, kills: int, done: threading.Event) -> int:
    """SIGKILL node1's rank `seconds` after each attempt's first step there, `kills` times; an
    attempt that finished meanwhile is left alone (a kill in its teardown would fail the job)."""
    struck: set[str] = set()
    killed = 0
    while len(struck) < kills and not done.is_set():
        found = _node1_rank(logs, struck)
        if found is None:
            done.wait(0.2)
            continue
        if done.wait(seconds):
            break
        struck.add(found[0])
        if not _training(logs, found[0]):
            continue
        with contextlib.suppress(ProcessLookupError):  # that attempt ended first
            os.kill(found[1], signal.SIGKILL)
            killed += 1
    return killed


def _injected_kills(logs: Path) -> int:
    """How many ranks a `kill@train` fault struck (each logs its FAULT injected line first)."""
    return sum(
        1
        for path in logs.glob("debug_rank*_*.log")
        for line in path.read_text(errors="replace").splitlines()
        if (m := FAULT_INJECTED.parse(line)) and m["action"] == "kill"
    )


def run(name: str, spec: str, steps: int, extra: list[str], port: int,
        kill_after: float | None, kills: int, kill_step: int | None = None) -> dict:  # fmt: skip
    out = DATA / f"run-goodput-{name}"
    subprocess.run(["rm", "-rf", str(out)], check=True)
    out.mkdir(parents=True)
    args = [f"--output_dir={out}", f"--train_shards={spec}", f"--val_shards={spec}",
            "--devices=1", "--batch_size=16", "--num_workers=1", "--max_epochs=-1",
            f"--max_steps={steps}", "--max_restarts=10", "--warmup_steps=10", *extra]  # fmt: skip
    t0 = time.time()
    with TwoHosts() as hosts:
        procs = [
            hosts.popen(i, [sys.executable, "-m", "ae.cli.launch", *args],
                        env=_node_env(i, port, kill_step), cwd=ROOT,
                        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            for i in (0, 1)
        ]  # fmt: skip
        done, struck = threading.Event(), [0]
        killer = None
        if kill_after is not None:
            killer = threading.Thread(target=lambda: struck.__setitem__(
                0, _kill_every(out / "logs", kill_after, kills, done)))  # fmt: skip
            killer.start()
        codes = [p.wait(timeout=1800) for p in procs]
        wall = time.time() - t0
        done.set()
        if killer is not None:
            killer.join()
    if codes != [0, 0]:
        raise SystemExit(f"{name}: the job failed (exits {codes}); see {out}/logs")
    doc = json.loads(subprocess.run(
        [sys.executable, "-m", "ae.diagnose", str(out / "logs"), "--json"],
        cwd=ROOT, capture_output=True, text=True, timeout=300, check=True).stdout)  # fmt: skip
    restarts = []
    for path in sorted((out / "logs").glob("train_*.log")):
        restarts += [r for ln in path.read_text(errors="replace").splitlines()
                     if (r := RESTART.parse(ln))]  # fmt: skip
    if kill_step is not None:
        struck[0] = _injected_kills(out / "logs")
    return {
        "launchers_wall_s": round(wall, 1),
        "kills": struck[0],
        "restarts": len(restarts),
        "steps_redone": sum(int(r["redone"]) for r in restarts),
        "goodput": doc["goodput"],
    }


def ratios(row: dict, base: dict) -> dict:
    """A run's figures over the fault-free run's."""
    g, b = row["goodput"], base["goodput"]
    return {
        "wall": round(g["wall_s"] / b["wall_s"], 2),
        "effective_share": round(g["effective_share"] / b["effective_share"], 2),
        "training_s": round(g["parts"]["training"] / b["parts"]["training"], 2),
    }


def show(name: str, row: dict) -> str:
    g = row["goodput"]
    parts = ", ".join(f"{k} {v:.1f}" for k, v in g["parts"].items() if v >= 0.05)
    share, wall = 100 * g["effective_share"], g["wall_s"]
    return (f"{name}: effective {share:.1f}% of {wall:.1f} s ({row['restarts']} restarts, "
            f"{row['steps_redone']} steps redone); {parts}")  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="a smoke run: one job, one kill")
    p.add_argument("--kill_after", type=float, help="seconds into each attempt (20)")
    a = p.parse_args()
    steps, kills, period = (QUICK_STEPS, 1, 10) if a.quick else (600, 3, 100)
    # Quick: killed by step count (AE_FAULT in node1's rank), not by time
    kill_after = None if a.quick else a.kill_after or 20.0
    record: dict = {"steps": steps, "kill_after_s": kill_after, "kills": kills,
                    "checkpointing_period": period, "hosts": 2, "runs": {}}  # fmt: skip
    if a.quick:
        record["kill_step"] = QUICK_KILL_STEP
        one_thread_per_process()
    ok, why = available()
    if not ok:
        print(f"skipped: two network-namespace hosts cannot be made here ({why})")
        record["skipped"] = why
        print(f"wrote {write_record('goodput', record, quick=a.quick)}")
        return
    cleanup_stale()
    spec = tiny_shard_set(DATA, 8, 500)
    every = [f"--checkpointing_period={period}"]
    minutes = ["--checkpoint_minutes=0.1"]  # a save at the first step 6 s after the last
    scenarios = [("no faults", every, None), (f"node1 rank killed {kills}x", every, kill_after),
                 (f"node1 rank killed {kills}x, --checkpoint_minutes=0.1", every + minutes,
                  kill_after)]  # fmt: skip
    kill_step = None
    if a.quick:  # one launch: the kill and the restart, with both kinds of save
        scenarios, kill_step = [(scenarios[2][0], every + minutes, None)], QUICK_KILL_STEP
    rows = record["runs"]
    for i, (name, extra, after) in enumerate(scenarios):
        rows[name] = run(f"s{i}", spec, steps, extra, 29651 + 2 * i, after, kills, kill_step)
        if "no faults" in rows and name != "no faults":
            rows[name]["vs_no_faults"] = ratios(rows[name], rows["no faults"])
        print(show(name, rows[name]), flush=True)
    print(f"wrote {write_record('goodput', record, quick=a.quick)}")


if __name__ == "__main__":
    main()
