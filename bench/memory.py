"""Memory over 5 epochs: RSS of each rank and each of its dataloader workers, per epoch, for 100
and 10,000 shards. Flat means < 5% growth from epoch 1 to epoch 4 (epoch 0 warms caches).

Measured from outside: the process tree of the launcher is sampled every 0.2 s with psutil, and
each sample is put in the epoch named by the latest `EPOCH e TRAINING START` marker of the rank's
own debug log. Workers are re-forked every epoch, so a leak in them would show in the rank.

Usage: python -m bench.memory   (writes bench/results/memory.json)
       python -m bench.memory --quick   (3 epochs of 10 shards, one rank with one worker:
                                        memory_quick.json)
"""

from __future__ import annotations

import argparse
import re
import time
from collections import defaultdict
from pathlib import Path

import psutil

from ae.log_lines import MARKER
from bench.common import launch_run, one_thread_per_process, tiny_shard_set, write_record

DATA = Path("/tmp/ae-bench-data")
EPOCHS = 5
_EPOCH = re.compile(r"EPOCH (\d+) TRAINING")


def _rank_of(proc: psutil.Process) -> int | None:
    try:
        env_rank = proc.environ().get("RANK")
    except psutil.Error:
        return None
    return int(env_rank) if env_rank is not None else None


def _current_epoch(logs: Path, rank: int) -> int | None:
    logs_for_rank = list(logs.glob(f"debug_rank{rank}_*.log"))
    if not logs_for_rank:
        return None
    epoch = None
    for line in logs_for_rank[0].read_text(errors="replace").splitlines():
        if (
            "TRAINING START" in line
            and (m := MARKER.parse(line))
            and (e := _EPOCH.match(m["name"]))
        ):
            epoch = int(e.group(1))
    return epoch


def measure(spec: str, out: Path, epochs: int, extra: list[str]) -> dict:
    """RSS per epoch of each rank and its workers; `extra` flags win."""
    proc = launch_run(
        [f"--train_shards={spec}", f"--val_shards={spec}", f"--max_epochs={epochs}",
         "--batch_size=256", "--num_workers=2", "--checkpointing_period=0", *extra],
        out,
    )  # fmt: skip
    # peaks[rank][epoch] = (rank RSS MB, max worker RSS MB)
    peaks: dict[int, dict[int, list[float]]] = defaultdict(lambda: defaultdict(lambda: [0.0, 0.0]))
    last_read = 0.0
    epochs: dict[int, int | None] = {}
    root = psutil.Process(proc.pid)
    while proc.poll() is None:
        now = time.monotonic()
        try:
            ranks = [p for p in root.children(recursive=True) if _rank_of(p) is not None]
        except psutil.Error:
            break
        if now - last_read > 1.0:  # the log is read once a second; RSS five times a second
            epochs = {_rank_of(p): _current_epoch(out / "logs", _rank_of(p)) for p in ranks}
            last_read = now
        for p in ranks:
            rank, epoch = _rank_of(p), epochs.get(_rank_of(p))
            if epoch is None:
                continue
            try:
                slot = peaks[rank][epoch]
                slot[0] = max(slot[0], p.memory_info().rss / 2**20)
                for w in p.children():
                    slot[1] = max(slot[1], w.memory_info().rss / 2**20)
            except psutil.Error:
                continue
        time.sleep(0.2)
    if proc.returncode != 0:
        raise SystemExit(f"run failed; see {out}/logs")
    result = {}
    for rank, by_epoch in sorted(peaks.items()):
        series = [by_epoch[e] for e in sorted(by_epoch)]
        growth = (series[-1][0] - series[1][0]) / series[1][0] if len(series) > 2 else 0.0
        result[str(rank)] = {"rank_mb": [round(s[0], 1) for s in series],
                             "worker_mb": [round(s[1], 1) for s in series],
                             "rank_growth": growth}  # fmt: skip
    return result


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="3 epochs of 10 shards: a smoke run")
    args = ap.parse_args()
    epochs, cases = (3, ((10, 1024),)) if args.quick else (EPOCHS, ((100, 1000), (10_000, 10)))
    extra = ["--devices=1", "--num_workers=1"] if args.quick else []  # quick: one launch, cheap
    if args.quick:
        one_thread_per_process()
    rows = {}
    for shards, per_shard in cases:
        spec = tiny_shard_set(DATA, shards, per_shard)
        rows[shards] = measure(spec, DATA / f"run-memory-{shards}", epochs, extra)
        for rank, r in rows[shards].items():
            print(
                f"{shards:>6} shards, rank {rank}: rank RSS/epoch {r['rank_mb']} MB, "
                f"worker peak/epoch {r['worker_mb']} MB, growth e1->e{epochs - 1} "
                f"{100 * r['rank_growth']:+.1f}% (target < 5%)"
            )
    record = {"epochs": epochs, "by_shards": rows}
    print(f"wrote {write_record('memory', record, quick=args.quick)}")


if __name__ == "__main__":
    main()
