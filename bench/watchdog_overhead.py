"""Training throughput with the stall watchdog + debug logging on, versus both off.

    .venv/bin/python -m bench.watchdog_overhead [--pairs 2] [--batches 1500] [--segments 200]
    .venv/bin/python -m bench.watchdog_overhead --quick   # 5 warm-up batches (not 300), then
                                                          # 2 segments of 7 batches (not 37),
                                                          # 1 pair of 14 batches

On: `--debug=true --stall_timeout=300`: the watchdog thread and its heartbeat file, and a
`Training step` line per batch (loss, LR, samples/s, RSS of rank and workers).
Off: `--debug=false --stall_timeout=0`: no thread, a progress line every 500 batches.
Both: the progress beats (two clock reads per hook, in DebugCallback; always on).

Where the overhead shows most: a tiny MLP (16 -> 8 -> 4 -> 8 -> 16) on 16-float vectors, batch
16, one process on CPU with one dataloader worker, so a step is a few milliseconds of Lightning
bookkeeping and almost no math. Training runs in this process through the real code path
(logging_cfg.configure, start_watchdog, build_trainer and its callbacks). Two measurements:

- interleaved (the figure): one run with everything on, in which segments of 37 batches
  alternate between on and off (off: the `Training step` lines switched off; the watchdog
  thread, asleep between its once-a-second checks, stays). Adjacent segments
  see the same load from other processes, so this holds on a busy machine. A control run
  labels segments on/off without switching anything: its "overhead" is the noise floor.
- whole runs: off and on runs alternate (`--pairs` of each); each is timed from batch 300 on.
  Honest end to end, but noisy where other processes compete for the CPUs.

Overheads are medians of (on - off) / off: over every two adjacent segments, and over run pairs.
Writes bench/results/watchdog_overhead.json (`--quick`: watchdog_overhead_quick.json).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning as L
import torch

import logging_cfg
from ae.config import parse_config
from ae.data.datamodule import ShardDataModule
from ae.forensics.loop_tracer import DebugCallback
from ae.forensics.watchdog import start_watchdog, stop_watchdog
from ae.training.model_build import build_model
from ae.training.trainer import build_trainer
from bench.common import synthetic_shards, write_record

BATCH = 16
SKIP = 300  # warm-up batches, excluded
QUICK_SKIP = 5
# Batches per interleaved segment: prime, so that periodic work (Lightning's metrics every 10
# steps, the CSV flush every 100, progress lines every 500) falls on on and off segments alike.
SEGMENT = 37
QUICK_SEGMENT = 7  # --quick: every path runs; the figures mean nothing anyway
MODES = {
    "off": ["--debug=false", "--stall_timeout=0"],
    "on": ["--debug=true", "--stall_timeout=300"],
}


def make_shards(folder: Path, batches: int) -> tuple[list[str], list[str]]:
    """One train shard of `batches` batches of 16-float vectors, one val batch."""
    train = synthetic_shards(folder / "train", "npy", 1, batches * BATCH, dim=16)
    val = synthetic_shards(folder / "val", "npy", 1, BATCH, dim=16)
    return train, val


class Stopwatch(L.Callback):
    """Wall and process CPU time at batch `skip` and at the last batch."""

    def __init__(self, skip: int = SKIP) -> None:
        self.skip = skip
        self.marks: list[tuple[int, float, float]] = []

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        done = trainer.global_step
        if done == self.skip or done == trainer.num_training_batches:
            self.marks.append((done, time.perf_counter(), time.process_time()))


class Toggle(L.Callback):
    """Switches the per-batch forensics off and on every `segment` batches, timing each
    segment. With switch=False it only labels the segments (the control: measures the noise)."""

    def __init__(
        self, trainer: L.Trainer, switch: bool = True, skip: int = SKIP, segment: int = SEGMENT
    ) -> None:
        self.switch, self.skip, self.segment = switch, skip, segment
        self.debug_cb = next(c for c in trainer.callbacks if isinstance(c, DebugCallback))
        self.on = True
        self.last = -1
        self.mark: tuple[float, float] | None = None
        self.segments: list[tuple[bool, float, float]] = []  # (on, wall s, cpu s)

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        done = trainer.global_step
        if done < self.skip or (done - self.skip) % self.segment or done == self.last:
            return
        self.last = done
        now = (time.perf_counter(), time.process_time())
        if self.mark is not None:
            self.segments.append((self.on, now[0] - self.mark[0], now[1] - self.mark[1]))
        self.on = not self.on
        if self.switch:
            self.debug_cb.debug = self.on
        self.mark = (time.perf_counter(), time.process_time())


def fit(
    mode: str, urls: tuple[list[str], list[str]], out: Path, spy: Callable[[L.Trainer], Any]
) -> Any:
    """Train once in this process as a rank does (ae/rank/train.py), with `spy(trainer)` added
    to the callbacks."""
    cfg = parse_config([
        f"--output_dir={out}", f"--batch_size={BATCH}", "--hidden_dim=8", "--latent_dim=4",
        "--num_workers=1", "--max_epochs=1", "--checkpointing_period=0", "--save_best=false",
        "--warmup_steps=0", *MODES[mode],
    ])  # fmt: skip
    ctx = logging_cfg.RankContext()
    paths = logging_cfg.configure(cfg.run.dir.logs, "bench", ctx, debug=cfg.obs.debug)
    start_watchdog(cfg.obs.stall_timeout, cfg.run.accelerator, ctx, paths, "bench")
    try:
        dm = ShardDataModule(cfg.data, *urls, seed=cfg.run.seed, debug=cfg.obs.debug)
        model, _ = build_model(dm.probe().spec, cfg.model, cfg.optim, ctx.world_size)
        trainer = build_trainer(cfg, ctx, "bench", {})
        watch = spy(trainer)
        trainer.callbacks.append(watch)
        trainer.fit(model, datamodule=dm)
    finally:
        stop_watchdog()
    return watch


def whole_run(
    mode: str, urls: tuple[list[str], list[str]], out: Path, skip: int
) -> tuple[float, float]:
    """(batches per second, CPU milliseconds per batch) after `skip` warm-up batches."""
    (b0, w0, c0), (b1, w1, c1) = fit(mode, urls, out, lambda _: Stopwatch(skip)).marks
    return (b1 - b0) / (w1 - w0), 1000 * (c1 - c0) / (b1 - b0)


def pct(off: float, on: float) -> float:
    return 100 * (on - off) / off


def interleaved(segments: list[tuple[bool, float, float]], k: int) -> float:
    """Median of (on - off) / off over every two adjacent segments, in both orders (off-on,
    on-off): slow drift cancels, and a hiccup of one segment weighs on one side only."""
    adjacent = [(a, b) if not a[0] else (b, a) for a, b in itertools.pairwise(segments)]
    return statistics.median(pct(off[k], on[k]) for off, on in adjacent)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=2, help="off/on whole-run pairs")
    parser.add_argument("--batches", type=int, default=1500, help="batches per whole run")
    parser.add_argument("--segments", type=int, default=200, help="interleaved segments")
    parser.add_argument("--quick", action="store_true", help="a smoke run: small sizes")
    args = parser.parse_args()
    skip, segment = (QUICK_SKIP, QUICK_SEGMENT) if args.quick else (SKIP, SEGMENT)
    if args.quick:
        # 2 segments: 3 timed (off, on, off), so both orders of an adjacent pair
        args.pairs, args.batches, args.segments = 1, skip + 2 * segment, 2
    torch.set_num_threads(1)  # as the launcher does for 2 ranks on 2 cores: no spinning threads
    t_start = time.monotonic()
    rate: dict[str, list[float]] = {m: [] for m in MODES}
    cpu: dict[str, list[float]] = {m: [] for m in MODES}
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        long_urls = make_shards(folder / "long", skip + (args.segments + 1) * segment)
        switched = fit(
            "on", long_urls, folder / "interleaved", lambda t: Toggle(t, True, skip, segment)
        )
        labelled = fit(
            "on", long_urls, folder / "control", lambda t: Toggle(t, False, skip, segment)
        )
        segments, control = switched.segments, labelled.segments
        urls = make_shards(folder / "short", args.batches)
        for i in range(args.pairs):
            for mode in ("off", "on") if i % 2 == 0 else ("on", "off"):
                r, c = whole_run(mode, urls, folder / f"{mode}{i}", skip)
                rate[mode].append(round(r, 1))
                cpu[mode].append(round(c, 3))
    whole = [pct(1 / off, 1 / on) for off, on in zip(rate["off"], rate["on"], strict=True)]
    result = {
        "load_average": [round(x, 2) for x in os.getloadavg()],
        "interleaved_segments": len(segments),
        "segment_batches": segment,
        "overhead_percent": round(interleaved(segments, 1), 2),
        "overhead_cpu_percent": round(interleaved(segments, 2), 2),
        # the same run and statistic with nothing switched: the noise of the measurement
        "control_percent": round(interleaved(control, 1), 2),
        "control_cpu_percent": round(interleaved(control, 2), 2),
        "segment_ms_per_batch": {  # medians
            mode: round(1000 * statistics.median(s[1] for s in segments if s[0] == on) / segment, 3)
            for mode, on in (("off", False), ("on", True))
        },
        "whole_runs_batches_per_s": rate,
        "whole_runs_cpu_ms_per_batch": cpu,
        "whole_runs_overhead_percent": round(statistics.median(whole), 2),
        "seconds": round(time.monotonic() - t_start, 1),
    }
    write_record("watchdog_overhead", result, quick=args.quick)
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
