"""Proof on a GPU (issue 40), one script, one JSON: throughput against a hand-written loop, no host
sync in a step, bf16 / compile / NCCL correctness, and GPU faults with their verdicts.

    python -m bench.gpu_proof                 # one GPU: ~7 min (--budget_s), then writes
                                              # gpu_proof.json and --artifacts (logs, grids)
    python -m bench.gpu_proof --quick         # CPU smoke run of every part (CUDA-only checks
                                              # recorded as `skipped: no CUDA`)

Parts (each records its result, or its error, in the JSON as soon as it ends; a part that does
not fit in what is left of --budget_s is recorded as skipped):

- `data`: 64-dim float32 vector shards (ae's writer, index sidecars; 16 x 131072 samples) and
  64x64 RGB photo crops (the 20 scikit-image photographs, `bench.real_images`; `--photos` names a
  folder holding them already, for a machine without a package registry).
- `hand`: a hand-written PyTorch loop (its own process) over the same shards: `resident` (every
  sample on the GPU, random batches: the GPU's ceiling) and `ae_loader` (ae's own DataModule
  loader, pinned batches copied with non_blocking): the same model (`build_model`), AdamW,
  clipping, bf16 autocast for the resnet.
- `ae`: the real launcher (`python -m ae.cli.launch`, what ./train_ae.sh execs) on the same
  shards and flags. A probe rides in each rank (a `sitecustomize` on PYTHONPATH, armed by
  GPU_PROOF_PROBE; it patches Lightning's Trainer, not ae): it times the rank's steps (CUDA events
  around each step, the loader's `next()` as data wait, host time in and between steps), then
  profiles 20 steps (kernel-busy share, torch.profiler), then runs 100 steps under
  `torch.cuda.set_sync_debug_mode("warn")` recording every synchronizing call with its stack,
  then stops the run.
  Configs: MLP at batch 4096 and 65536 (vector shards, counted, the columnar path), the resnet
  f=8 at 64x64 in bf16-mixed (photos, resampled: no epoch ends). Targets: resnet ae >= 0.9x the
  hand loop; MLP at 65536 keeps the GPU >= 80% busy (kernel share).
- `oom`: a real CUDA out-of-memory at reconstruction sampling: the probe fills all GPU memory
  but `--oom_leave_mb` one step before sampling (`--sample_batch_size=4096`); the run must go on
  (SAMPLING OOM, batch halved) and finish.
- `resume_bf16`: resnet in bf16-mixed with `--debug`: 2 epochs straight; 1 epoch then
  `--resume_from_checkpoint=last` to 2: per-step losses and final weights compared, checkpoints,
  metrics and grids listed.
- `compile`: the same with `--compile=true`, 1 epoch then resumed to 2 (GPU only).
- `nccl_stall`: one run forced onto DDP with NCCL at world size 1 (the probe swaps Lightning's
  `strategy="auto"`: ae builds no process group for one rank), `--debug`: NCCL's init lines in
  the native log; a CUDA kernel that spins ~16 s at step 15 (`AE_FAULT=gpusleep@train` where ae
  has it, else the probe) -> the STALL report (phase, main thread's stack), `ae-diagnose --dump`
  (Flight Recorder through the NCCL path) and `ae-diagnose --json` live, then the run resolves
  and finishes. On the CPU: gloo and `AE_FAULT=sleep@train`.

Writes `gpu_proof.json` (`--quick`: gpu_proof_quick.json) where bench records go
(`$AE_BENCH_RESULTS`), and into --artifacts: `gpu_proof_logs.tar.gz` (every run's logs, metrics,
probe files; no checkpoints), `grid_bf16.png`, `grid_compile.png`.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.abc
import importlib.util
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tarfile
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

# Only the standard library above: each rank imports this module at start (through the probe's
# sitecustomize), before ae sends its native output to the log and before torch.
_AE_SPEC = importlib.util.find_spec("ae")
ROOT = Path(_AE_SPEC.origin).resolve().parent.parent if _AE_SPEC and _AE_SPEC.origin else Path()
NAME = "gpu_proof"
PROBE_ENV, MODULE_ENV = "GPU_PROOF_PROBE", "GPU_PROOF_MODULE"
SYNC_WARNING = "synchroniz"  # torch: "called a synchronizing CUDA operation"
DIM = 64


def _ae() -> SimpleNamespace:
    """Every ae (and bench) name this bench uses, imported here only: ae.data is being
    reorganised, and its import paths change in this one place."""
    from ae.config import parse_config
    from ae.data.datamodule import ShardDataModule
    from ae.data.shards.index import write_index
    from ae.data.shards.spec import resolve_shards
    from ae.data.shards.writer import npy_bytes, png_bytes, write_shard
    from ae.forensics.faults import ACTIONS
    from ae.log_lines import FAULT_INJECTED, SAMPLING_END, SAMPLING_OOM, STALL, STALL_RESOLVED
    from ae.training.model import build_model
    from bench.common import results_dir, write_record
    from bench.models_bench import VAL_PHOTOS, photo_crops
    from bench.real_images import SKIMAGE, real_photos

    return SimpleNamespace(
        parse_config=parse_config,
        ShardDataModule=ShardDataModule,
        resolve_shards=resolve_shards,
        npy_bytes=npy_bytes,
        png_bytes=png_bytes,
        write_shard=write_shard,
        write_index=write_index,
        FAULT_ACTIONS=ACTIONS,
        FAULT_INJECTED=FAULT_INJECTED,
        SAMPLING_END=SAMPLING_END,
        SAMPLING_OOM=SAMPLING_OOM,
        STALL=STALL,
        STALL_RESOLVED=STALL_RESOLVED,
        build_model=build_model,
        results_dir=results_dir,
        write_record=write_record,
        VAL_PHOTOS=VAL_PHOTOS,
        photo_crops=photo_crops,
        SKIMAGE=SKIMAGE,
        real_photos=real_photos,
    )


# =============================================================================================
# The probe: inside each rank of a launched run
# =============================================================================================

SITECUSTOMIZE = '''"""bench/gpu_proof.py's probe, armed in the ranks of a run by GPU_PROOF_PROBE."""
import importlib.machinery
import importlib.util
import os
import sys

if os.environ.get("GPU_PROOF_PROBE") and os.environ.get("RANK") is not None:
    _path = os.environ["GPU_PROOF_MODULE"]
    _spec = importlib.util.spec_from_file_location("gpu_proof_probe", _path)
    _mod = importlib.util.module_from_spec(_spec)
    sys.modules["gpu_proof_probe"] = _mod
    _spec.loader.exec_module(_mod)
    _mod.install_probe()
# the sitecustomize this one shadows, if any
_here = os.path.dirname(os.path.abspath(__file__))
_rest = [p for p in sys.path if os.path.abspath(p or ".") != _here]
_next = importlib.machinery.PathFinder.find_spec("sitecustomize", _rest)
if _next is not None and _next.loader is not None:
    _next.loader.exec_module(importlib.util.module_from_spec(_next))
'''


def install_probe() -> None:
    """Patch Lightning's Trainer as soon as its module is imported (by ae.rank.train)."""
    sys.meta_path.insert(0, _TrainerHook())


class _TrainerHook(importlib.abc.MetaPathFinder):
    target = "lightning.pytorch.trainer.trainer"

    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        if name != self.target:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None:
            return spec
        exec_module = spec.loader.exec_module

        def patched(module: Any) -> None:
            exec_module(module)
            _patch_trainer(module.Trainer)

        spec.loader.exec_module = patched  # type: ignore[method-assign]
        return spec


def _probe_cfg() -> dict[str, Any]:
    return json.loads(Path(os.environ[PROBE_ENV]).read_text())


def _patch_trainer(trainer_cls: Any) -> None:
    cfg = _probe_cfg()
    init, fit = trainer_cls.__init__, trainer_cls.fit

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        if cfg.get("force_ddp") and kwargs.get("strategy", "auto") == "auto":
            from datetime import timedelta

            from lightning.pytorch.strategies import DDPStrategy

            backend = "nccl" if kwargs.get("accelerator") == "gpu" else "gloo"
            kwargs["strategy"] = DDPStrategy(
                process_group_backend=backend, timeout=timedelta(seconds=600)
            )
        init(self, *args, **kwargs)

    def patched_fit(self: Any, model: Any, *args: Any, **kwargs: Any) -> Any:
        probe = make_probe(cfg)
        self.callbacks.append(probe)  # last: its hooks see every other callback's work
        if (dm := kwargs.get("datamodule")) is not None:
            loader_of = dm.train_dataloader

            def train_dataloader() -> Any:
                loader = loader_of()
                _time_loader(loader, probe.data_clock)
                return loader

            dm.train_dataloader = train_dataloader
        return fit(self, model, *args, **kwargs)

    trainer_cls.__init__ = __init__
    trainer_cls.fit = patched_fit


class _Clock:
    """Seconds spent in the train loader's `next()`, summed."""

    def __init__(self) -> None:
        self.total = 0.0


class _TimedIterator:
    def __init__(self, it: Iterator[Any], clock: _Clock) -> None:
        self.it, self.clock = it, clock

    def __iter__(self) -> _TimedIterator:
        return self

    def __next__(self) -> Any:
        t0 = time.perf_counter()
        try:
            return next(self.it)
        finally:
            self.clock.total += time.perf_counter() - t0

    def __len__(self) -> int:
        return len(self.it)  # type: ignore[arg-type]

    def __getattr__(self, name: str) -> Any:
        return getattr(self.it, name)


def _time_loader(loader: Any, clock: _Clock) -> None:
    """Give the loader (the same object every epoch) a subclass whose iterator times `next()`;
    isinstance checks on it still hold."""
    if getattr(loader, "_gpu_proof_timed", False):
        return
    base = type(loader)

    def __iter__(self: Any) -> _TimedIterator:
        return _TimedIterator(base.__iter__(self), clock)

    loader.__class__ = type(
        f"Timed{base.__name__}", (base,), {"__iter__": __iter__, "_gpu_proof_timed": True}
    )


class Windows:
    """The phases of a measured run, after each step: warmup (steps) -> timed (seconds, and at
    least `min_steps`) -> profile (steps) -> sync (steps) -> done. A phase of 0 is skipped."""

    def __init__(self, warmup: int, seconds: float, min_steps: int, profile: int, sync: int):
        self.plan = [("warmup", warmup), ("timed", seconds), ("profile", profile), ("sync", sync)]
        self.plan = [p for p in self.plan if p[1] > 0]
        self.min_steps = min_steps
        self.index = 0
        self.start_step, self.start_t = 0, time.perf_counter()

    @property
    def phase(self) -> str:
        return self.plan[self.index][0] if self.index < len(self.plan) else "done"

    def after_step(self, step: int) -> list[tuple[str, str]]:
        """`step`: optimizer steps done. Returns the transitions: ("end", phase), ("start",
        phase), ("done", "")."""
        if self.index >= len(self.plan):
            return []
        name, amount = self.plan[self.index]
        now, done = time.perf_counter(), step - self.start_step
        if name == "timed":
            finished = now - self.start_t >= amount and done >= self.min_steps
        else:
            finished = done >= amount
        if not finished:
            return []
        out = [("end", name)]
        self.index += 1
        self.start_step, self.start_t = step, now
        out.append(("start", self.phase) if self.index < len(self.plan) else ("done", ""))
        return out

    def first(self) -> list[tuple[str, str]]:
        return [("start", self.phase)] if self.plan else [("done", "")]


class StepRecorder:
    """Per step, in the timed window: data wait, host time in the step and between steps, and
    the GPU time between CUDA events recorded at the step's start and end."""

    def __init__(self, torch: Any, cuda: bool) -> None:
        self.torch, self.cuda = torch, cuda
        self.on = False
        self.rows: list[dict[str, float]] = []
        self.events: list[tuple[Any, Any]] = []
        self.samples = 0
        self.epoch_starts: list[int] = []  # indices (in rows) of steps that begin an epoch
        self._start = self._last_end = 0.0
        self._data = 0.0
        self._ev: Any = None
        self._n = 0

    def sync(self) -> None:
        if self.cuda:
            self.torch.cuda.synchronize()

    def begin(self) -> None:
        self.sync()
        self.on, self.rows, self.events, self.samples, self.epoch_starts = True, [], [], 0, []
        self.t0, self.wall0 = time.perf_counter(), time.time()
        self._last_end = self.t0

    def batch_start(self, data_wait: float, samples: int, epoch_start: bool = False) -> None:
        if not self.on:
            return
        self._start, self._data, self._n = time.perf_counter(), data_wait, samples
        self.samples += samples
        if epoch_start:
            self.epoch_starts.append(len(self.rows))
        if self.cuda:
            self._ev = self.torch.cuda.Event(enable_timing=True)
            self._ev.record()

    def batch_end(self) -> None:
        if not self.on or not self._start:
            return
        now = time.perf_counter()
        if self.cuda:
            end = self.torch.cuda.Event(enable_timing=True)
            end.record()
            self.events.append((self._ev, end))
        self.rows.append(
            {
                "wall": now - self._last_end,
                "data": self._data,
                "in_step": now - self._start,
                "between": self._start - self._last_end - self._data,
                "samples": self._n,
            }
        )
        self._last_end, self._start = now, 0.0

    def end(self) -> dict[str, Any]:
        self.sync()
        self.on = False
        seconds = time.perf_counter() - self.t0
        steps = len(self.rows)
        ms = {
            k: 1000 * statistics.fmean(r[k] for r in self.rows) if steps else None
            for k in ("wall", "data", "in_step", "between")
        }
        gpu = [a.elapsed_time(b) for a, b in self.events]  # ms
        walls = [1000 * r["wall"] for r in self.rows]
        boundary = [walls[i] for i in self.epoch_starts if i < len(walls)]
        row: dict[str, Any] = {
            "steps": steps,
            "samples": self.samples,
            "seconds": seconds,
            "samples_per_s": self.samples / seconds if seconds else None,
            "steps_per_s": steps / seconds if seconds else None,
            "ms_per_step": {
                "wall": ms["wall"],
                "wall_median": statistics.median(walls) if walls else None,
                "data_wait": ms["data"],
                "host_in_step": ms["in_step"],
                "host_between_steps_other": ms["between"],
                "gpu_in_step_events": statistics.fmean(gpu) if gpu else None,
            },
            "gpu_busy": {
                # device time between each step's two events / the window's wall time: high
                # both when the GPU is the bound and when launches trickle in (see kernel_share)
                "in_step_share_events": sum(gpu) / 1000 / seconds if gpu else None,
            },
            "window": {"t0": self.wall0, "t1": time.time()},
        }
        if boundary:
            # the steps that begin an epoch carry its change (loader restart, epoch-end hooks)
            starts = set(self.epoch_starts)
            steady = [r for i, r in enumerate(self.rows) if i not in starts]
            row["epoch_starts_in_window"] = len(boundary)
            row["ms_epoch_start_step"] = statistics.fmean(boundary)
            row["samples_per_s_without_epoch_starts"] = (
                sum(r["samples"] for r in steady) / sum(r["wall"] for r in steady)
                if steady
                else None
            )
        return row


def kernel_busy(prof: Any, window_s: float, steps: int) -> dict[str, Any]:
    """From a torch.profiler run over `steps` steps: the union of CUDA kernel intervals (and of
    memcpy/memset ones) over the window's wall time."""
    from torch.autograd import DeviceType

    spans: dict[str, list[tuple[float, float]]] = {"kernel": [], "copy": []}
    source = "events"
    for e in prof.events():
        if getattr(e, "device_type", None) != DeviceType.CUDA:
            continue
        kind = "copy" if e.name.startswith(("Memcpy", "Memset")) else "kernel"
        spans[kind].append((e.time_range.start, e.time_range.end))  # us
    if not spans["kernel"]:  # device events missing from the FunctionEvents: Kineto's own list
        source = "kineto"
        for k in prof.profiler.kineto_results.events():
            if k.device_type() != DeviceType.CUDA:
                continue
            kind = "copy" if k.name().startswith(("Memcpy", "Memset")) else "kernel"
            start = k.start_ns() / 1000
            spans[kind].append((start, start + k.duration_ns() / 1000))

    def union(s: list[tuple[float, float]]) -> float:
        total, end = 0.0, float("-inf")
        for a, b in sorted(s):
            if b > end:
                total += b - max(a, end)
                end = b
        return total / 1e6

    kernel, copy = union(spans["kernel"]), union(spans["copy"])
    return {
        "kernels": len(spans["kernel"]),
        "kernel_share": kernel / window_s if spans["kernel"] else None,
        "copy_share": copy / window_s if spans["copy"] else None,
        "kernel_ms_per_step": 1000 * kernel / steps if steps else None,
        "window_s": window_s,
        "steps": steps,
        "source": source,
    }


class SyncCapture:
    """`torch.cuda.set_sync_debug_mode("warn")` over a window; every synchronizing call is kept
    with its step, thread and Python stack instead of being shown."""

    def __init__(self, torch: Any, step: Callable[[], int], cuda: bool) -> None:
        import warnings

        self.torch, self.step, self.cuda, self.warnings = torch, step, cuda, warnings
        self.syncs: list[dict[str, Any]] = []
        self._ctx: Any = None

    def start(self) -> None:
        w = self.warnings
        self._ctx = w.catch_warnings()
        self._ctx.__enter__()
        w.filterwarnings("always", message=f".*{SYNC_WARNING}")
        previous = w.showwarning

        def show(message: Any, category: Any, filename: str, lineno: int, *rest: Any) -> None:
            if SYNC_WARNING not in str(message):
                return previous(message, category, filename, lineno, *rest)
            frames = [
                f for f in traceback.extract_stack()[:-1] if not f.filename.endswith("warnings.py")
            ]
            self.syncs.append(
                {
                    "step": self.step(),
                    "thread": threading.current_thread().name,
                    "where": f"{filename}:{lineno}",
                    "stack": [f"{f.filename}:{f.lineno} {f.name}" for f in frames[-14:]],
                }
            )
            return None

        w.showwarning = show
        if self.cuda:
            self.torch.cuda.set_sync_debug_mode("warn")

    def stop(self) -> None:
        if self.cuda:
            self.torch.cuda.set_sync_debug_mode("default")
        if self._ctx is not None:
            self._ctx.__exit__(None, None, None)
            self._ctx = None

    def summary(self, steps: int, cadences: list[int]) -> dict[str, Any]:
        """Syncs by step; `at_cadence`: in a step where a logging cadence falls (the loggers'
        `log_every_n_steps`: ae logs when (global_step + 1) % n == 0, inside the step, and
        Lightning hands the values on after the optimizer step, when global_step % n == 0; the
        progress lines' `--log_every_n_train_batches`)."""

        def at_cadence(s: int) -> bool:
            return any((s + 1) % n == 0 or s % n == 0 for n in cadences)

        outside = [s for s in self.syncs if not at_cadence(s["step"])]
        sites: dict[str, dict[str, Any]] = {}
        for s in self.syncs:
            key = _site(s["stack"])
            site = sites.setdefault(key, {"count": 0, "at_cadence": 0, "stack": s["stack"]})
            site["count"] += 1
            site["at_cadence"] += at_cadence(s["step"])
        return {
            "steps": steps,
            "cadences": cadences,
            "syncs": len(self.syncs),
            "steps_with_syncs": len({s["step"] for s in self.syncs}),
            "outside_cadence": len(outside),
            "sites": sites,
        }


def _site(stack: list[str]) -> str:
    """The innermost frame of ae's (else the innermost of the stack): where a sync comes from."""
    for frame in reversed(stack):
        if "/ae/" in frame and "gpu_proof" not in frame:
            return frame
    return stack[-1] if stack else "?"


def make_probe(cfg: dict[str, Any]) -> Any:
    """The probe's Lightning callback (Lightning and torch imported only now)."""
    import lightning as L
    import torch

    class Probe(L.Callback):
        def __init__(self) -> None:
            self.cfg = cfg
            self.cuda = torch.cuda.is_available()
            self.data_clock = _Clock()
            self.recorder = StepRecorder(torch, self.cuda)
            w = cfg.get("windows")
            self.windows = Windows(**w) if w else None
            self.out: dict[str, Any] = {"rank": int(os.environ.get("RANK", 0)), "errors": []}
            self.trainer: Any = None
            self.sync = SyncCapture(torch, lambda: self.trainer.global_step, self.cuda)
            self._data_mark = 0.0
            self._prof: Any = None
            self._prof_t0 = 0.0
            self._ballast: Any = None
            self._slept = False

        # --- hooks ---------------------------------------------------------------------
        def on_train_start(self, trainer: Any, pl_module: Any) -> None:
            self.trainer = trainer
            self.out["log_every_n_steps"] = trainer.log_every_n_steps
            self.out["strategy"] = type(trainer.strategy).__name__
            self.out["precision"] = str(trainer.precision)
            if self.windows is not None:
                self._act(self.windows.first())
            self._write()

        def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, idx: int):
            data = self.data_clock.total - self._data_mark
            n = len(batch) if hasattr(batch, "__len__") else 0
            self.recorder.batch_start(data, n, epoch_start=idx == 0)
            sleep = self.cfg.get("gpu_sleep")
            if sleep and not self._slept and trainer.global_step >= sleep["step"]:
                self._slept = True
                self._gpu_sleep(sleep["secs"])

        def on_train_batch_end(self, trainer: Any, pl_module: Any, *args: Any) -> None:
            self.recorder.batch_end()
            ballast = self.cfg.get("ballast")
            if ballast and self._ballast is None and trainer.global_step >= ballast["step"]:
                self._fill(ballast["leave_mb"])
            if self.windows is not None:
                self._act(self.windows.after_step(trainer.global_step))
            self._data_mark = self.data_clock.total

        def on_fit_end(self, trainer: Any, pl_module: Any) -> None:
            self.sync.stop()
            if self.cuda:
                self.out["memory"] = {
                    "max_allocated_mb": torch.cuda.max_memory_allocated() / 2**20,
                    "max_reserved_mb": torch.cuda.max_memory_reserved() / 2**20,
                }
            self._write()

        def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException):
            self.out["errors"].append(f"{type(exception).__name__}: {exception}")
            self._write()

        # --- the phases -------------------------------------------------------------------
        def _act(self, transitions: list[tuple[str, str]]) -> None:
            for edge, phase in transitions:
                try:
                    self._transition(edge, phase)
                except Exception:
                    self.out["errors"].append(f"{edge} {phase}: {traceback.format_exc()}")
            if transitions:
                self._write()

        def _transition(self, edge: str, phase: str) -> None:
            step = self.trainer.global_step
            if (edge, phase) == ("start", "timed"):
                self.out["timed_from_step"] = step
                self.recorder.begin()
            elif (edge, phase) == ("end", "timed"):
                self.out["throughput"] = self.recorder.end()
            elif (edge, phase) == ("start", "profile"):
                self._profile_start()
            elif (edge, phase) == ("end", "profile"):
                self._profile_end()
            elif (edge, phase) == ("start", "sync"):
                self.out["sync_from_step"] = step
                self.sync.start()
                if not self.cuda:  # nothing to warn about: check the capture itself
                    import warnings

                    warnings.warn(
                        "called a synchronizing CUDA operation (CPU self-test)", stacklevel=1
                    )
            elif (edge, phase) == ("end", "sync"):
                self.sync.stop()
                steps = step - self.out["sync_from_step"]
                cadences = [self.trainer.log_every_n_steps, *self.cfg.get("cadences", [])]
                self.out["sync"] = self.sync.summary(steps, cadences)
                self.out["sync"]["cuda"] = self.cuda
            elif edge == "done" and self.cfg.get("stop", True):
                self.out["stopped_at_step"] = step
                self.trainer.should_stop = True

        def _profile_start(self) -> None:
            from torch.profiler import ProfilerActivity, profile

            acts = [ProfilerActivity.CUDA] if self.cuda else [ProfilerActivity.CPU]
            self.recorder.sync()
            self._prof = profile(activities=acts)
            self._prof.start()
            self._prof_t0, self._prof_step = time.perf_counter(), self.trainer.global_step

        def _profile_end(self) -> None:
            self.recorder.sync()
            window = time.perf_counter() - self._prof_t0
            self._prof.stop()
            steps = self.trainer.global_step - self._prof_step
            if self.cuda:
                self.out["profile"] = kernel_busy(self._prof, window, steps)
            else:
                self.out["profile"] = {"skipped": "no CUDA", "window_s": window, "steps": steps}
            self._prof = None

        # --- faults -----------------------------------------------------------------------
        def _gpu_sleep(self, secs: float) -> None:
            """A kernel spinning `secs` seconds (its cycles calibrated here), launched without
            waiting: the host stalls wherever it next waits for the GPU."""
            if not self.cuda:
                time.sleep(secs)
                return
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            torch.cuda._sleep(20_000_000)
            b.record()
            b.synchronize()
            per_s = 20_000_000 / (a.elapsed_time(b) / 1000)
            torch.cuda._sleep(int(per_s * secs))
            self.out["gpu_sleep"] = {
                "step": self.trainer.global_step,
                "secs": secs,
                "cycles_per_s": per_s,
                "at": time.time(),
            }
            self._write()

        def _fill(self, leave_mb: float) -> None:
            """All free GPU memory but `leave_mb` taken by one tensor, held to the end."""
            record: dict[str, Any] = {"step": self.trainer.global_step, "leave_mb": leave_mb}
            if self.cuda:
                torch.cuda.synchronize()
                free, total = torch.cuda.mem_get_info()
                record.update(
                    free_mb=free / 2**20,
                    total_mb=total / 2**20,
                    allocated_mb=torch.cuda.memory_allocated() / 2**20,
                    reserved_mb=torch.cuda.memory_reserved() / 2**20,
                    max_allocated_mb=torch.cuda.max_memory_allocated() / 2**20,
                )
                size = int(free - leave_mb * 2**20)
                for _ in range(8):
                    try:
                        self._ballast = torch.empty(max(size, 1), dtype=torch.uint8, device="cuda")
                        break
                    except torch.cuda.OutOfMemoryError:
                        size = int(size * 0.98)
                record["ballast_mb"] = size / 2**20 if self._ballast is not None else 0
                record["free_after_mb"] = torch.cuda.mem_get_info()[0] / 2**20
            else:
                self._ballast = True
                record["skipped"] = "no CUDA"
            self.out["ballast"] = record
            self._write()

        def _write(self) -> None:
            path = Path(f"{self.cfg['out']}.rank{self.out['rank']}.json")
            tmp = path.with_suffix(".tmp")
            tmp.write_text(json.dumps(self.out, indent=1, default=str))
            tmp.replace(path)

    return Probe()


# =============================================================================================
# The hand-written loop (its own process: `--worker hand SPEC OUT`)
# =============================================================================================


def vec_array(shard: int, per_shard: int, dim: int = DIM) -> Any:
    """Shard `shard`'s vectors, regenerated anywhere from the same seed."""
    import numpy as np

    return np.random.default_rng(1000 + shard).random((per_shard, dim), dtype=np.float32)


def hand_worker(spec_path: Path, out_path: Path) -> None:
    import torch

    a = _ae()
    spec = json.loads(spec_path.read_text())
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    results: dict[str, Any] = {"device": str(device)}
    for conf in spec["configs"]:
        try:
            results[conf["name"]] = _hand_config(a, torch, conf, device, Path(spec["work"]))
        except Exception:
            results[conf["name"]] = {"error": traceback.format_exc()}
        out_path.write_text(json.dumps(results, indent=1, default=str))
        print(f"hand {conf['name']}: done", flush=True)


def _hand_config(a: Any, torch: Any, conf: dict, device: Any, work: Path) -> dict[str, Any]:
    cfg = a.parse_config(
        [
            *conf["flags"],
            f"--output_dir={work / 'hand' / conf['name']}",
            f"--count_cache={work / 'cache'}",
        ]
    )
    train_urls, val_urls = a.resolve_shards(cfg.data.train_shards, cfg.data.val_shards)
    dm = a.ShardDataModule(cfg.data, train_urls, val_urls, seed=cfg.run.seed)
    dm.setup("fit")
    bf16 = cfg.run.precision == "bf16-mixed"
    batch = cfg.data.batch_size
    out: dict[str, Any] = {"batch_size": batch, "precision": cfg.run.precision}
    res = conf["resident"]
    if res["kind"] == "vec":
        import numpy as np

        data = np.concatenate([vec_array(i, res["per_shard"]) for i in range(res["shards"])])
        out["same_samples_as_shards"] = bool(
            torch.equal(dm.first_samples(4), torch.from_numpy(data[:4]))
        )
        resident = torch.from_numpy(data).to(device)
    else:
        resident = dm.first_samples(res["n"]).to(device)
    out["resident_samples"] = len(resident)

    def model() -> Any:
        torch.manual_seed(0)
        m, _ = a.build_model(dm.spec, cfg.model, cfg.optim, 1)
        return m.to(device)

    def on_device() -> Iterator[Any]:
        n = len(resident)
        while True:
            yield resident[torch.randint(n, (batch,), device=device)]

    def ae_loader() -> Iterator[Any]:
        loader = dm.train_dataloader()
        epoch = 0
        while True:
            dm.set_epoch(epoch)
            yield from loader
            epoch += 1

    kw = dict(
        device=device,
        bf16=bf16,
        lr=cfg.optim.learning_rate,
        wd=cfg.optim.weight_decay,
        clip=cfg.optim.gradient_clip_val,
        windows=conf["windows"],
    )
    out["resident"] = _hand_run(torch, model(), on_device(), **kw)
    out["ae_loader"] = _hand_run(torch, model(), ae_loader(), **kw)
    return out


def _hand_run(
    torch: Any,
    model: Any,
    batches: Iterator[Any],
    *,
    device: Any,
    bf16: bool,
    lr: float,
    wd: float,
    clip: float,
    windows: dict,
) -> dict[str, Any]:
    """What Lightning's automatic optimization does for ae's AutoEncoder, by hand: autocast
    forward (bf16-mixed), MSE, zero_grad, backward, clip, AdamW step, LR schedule step."""
    cuda = device.type == "cuda"
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=wd)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 50))
    params = [p for p in model.parameters() if p.requires_grad]
    autocast = (
        torch.autocast(device.type, dtype=torch.bfloat16) if bf16 else contextlib.nullcontext()
    )
    rec = StepRecorder(torch, cuda)
    win = Windows(**{**windows, "sync": 0})
    row: dict[str, Any] = {}
    prof: Any = None
    prof_t0, prof_step = 0.0, 0
    step = 0
    transitions = win.first()
    while True:
        for edge, phase in transitions:
            if (edge, phase) == ("start", "timed"):
                rec.begin()
            elif (edge, phase) == ("end", "timed"):
                row = rec.end()
            elif (edge, phase) == ("start", "profile") and cuda:
                from torch.profiler import ProfilerActivity, profile

                rec.sync()
                prof = profile(activities=[ProfilerActivity.CUDA])
                prof.start()
                prof_t0, prof_step = time.perf_counter(), step
            elif (edge, phase) == ("end", "profile") and prof is not None:
                rec.sync()
                window = time.perf_counter() - prof_t0
                prof.stop()
                row["profile"] = kernel_busy(prof, window, step - prof_step)
        if win.phase == "done":
            break
        t0 = time.perf_counter()
        x = next(batches)
        rec.batch_start(time.perf_counter() - t0, len(x))
        x = x.to(device, non_blocking=True)
        with autocast:
            loss = torch.nn.functional.mse_loss(model(x), x)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(params, clip)
        opt.step()
        sched.step()
        rec.batch_end()
        step += 1
        transitions = win.after_step(step)
    if not cuda:
        row["profile"] = {"skipped": "no CUDA"}
    row["final_loss"] = float(loss.detach().float())
    return row


# =============================================================================================
# The orchestrator (never initialises CUDA itself: the GPU stays whole for the runs)
# =============================================================================================


class Budget:
    def __init__(self, seconds: float) -> None:
        self.end = time.monotonic() + seconds

    def left(self) -> float:
        return self.end - time.monotonic()

    def slot(self, want: float, reserve: float = 0.0) -> float:
        """Seconds a part may take: `want`, cut to what is left after `reserve` for later ones."""
        return max(0.0, min(want, self.left() - reserve))


class Proof:
    """The record, written after every part; parts run through `part`."""

    def __init__(self, args: argparse.Namespace, a: Any) -> None:
        self.args, self.a = args, a
        self.quick = args.quick
        self.work = Path(args.work)
        self.runs = self.work / "runs"
        self.artifacts = Path(args.artifacts)
        self.budget = Budget(args.budget_s)
        self.cuda = _gpu_present()
        self.lock = threading.Lock()
        self.record: dict[str, Any] = {
            "device": _device_info(),
            "budget_s": args.budget_s,
            "data": {},
            "hand": {},
            "throughput": {},
            "sync_check": {},
            "targets": {},
            "correctness": {},
            "faults": {},
            "errors": {},
            "skipped": {},
            "part_seconds": {},
            "artifacts": [],
        }
        self.nvml = Utilisation(self.cuda)
        self.site_dir = self.work / "probe_site"
        self.specs: SimpleNamespace | None = None

    # --- bookkeeping -------------------------------------------------------------------------
    def save(self) -> None:
        with self.lock:
            self.a.write_record(
                NAME, json.loads(json.dumps(self.record, default=str)), quick=self.quick
            )

    def put(self, section: str, key: str, value: Any) -> None:
        with self.lock:
            self.record[section][key] = value
        self.save()

    def part(self, name: str, fn: Callable[[], None], need: float) -> None:
        """Run part `name` unless fewer than `need` seconds are left; its error is recorded."""
        if self.budget.left() < need:
            self.put(
                "skipped",
                name,
                f"out of time ({self.budget.left():.0f} s left, {need:.0f} s needed)",
            )
            _say(f"{name}: skipped (out of time)")
            return
        _say(f"{name}: start ({self.budget.left():.0f} s left)")
        t0 = time.monotonic()
        try:
            fn()
        except Exception:
            self.put("errors", name, traceback.format_exc())
            _say(f"{name}: ERROR\n{traceback.format_exc()}")
        self.put("part_seconds", name, round(time.monotonic() - t0, 1))
        _say(f"{name}: done in {time.monotonic() - t0:.0f} s")

    # --- launching runs ----------------------------------------------------------------------
    def env(self, probe: dict[str, Any] | None = None, name: str = "", **extra: str) -> dict:
        env = {
            k: v
            for k, v in os.environ.items()
            if k not in ("AE_RUN_TS", "MASTER_PORT", "AE_FAULT", PROBE_ENV)
        }
        env.update(AE_CACHE_DIR=str(self.work / "cache"), PYTHONUNBUFFERED="1", **extra)
        if self.quick:  # one thread a process: a shared 2-core box thrashes with more (bf16 x10)
            env["OMP_NUM_THREADS"] = "1"
        paths = [str(ROOT), *filter(None, [env.get("PYTHONPATH")])]
        if probe is not None:
            self.site_dir.mkdir(parents=True, exist_ok=True)
            (self.site_dir / "sitecustomize.py").write_text(SITECUSTOMIZE)
            cfg_path = self.runs / f"{name}.probe.json"
            cfg_path.write_text(json.dumps({"out": str(self.runs / f"{name}.probe"), **probe}))
            env[PROBE_ENV], env[MODULE_ENV] = str(cfg_path), str(Path(__file__).resolve())
            paths.insert(0, str(self.site_dir))
        env["PYTHONPATH"] = os.pathsep.join(paths)
        return env

    def launch(
        self,
        name: str,
        args: list[str],
        timeout: float,
        *,
        probe: dict | None = None,
        env: dict[str, str] | None = None,
        out: Path | None = None,
        watch: Callable[[subprocess.Popen, Path], None] | None = None,
    ) -> dict[str, Any]:
        """One run of the real launcher to its end (killed, with every process of the run,
        after `timeout` s), in a fresh folder `runs/<name>`, or in `out` as it is (a resume)."""
        if out is None:
            out = self.runs / name
            shutil.rmtree(out, ignore_errors=True)
        self.runs.mkdir(parents=True, exist_ok=True)
        for old in self.runs.glob(f"{name}.probe.rank*.json"):
            old.unlink()
        console = self.runs / f"{name}.console.log"
        run_env = self.env(probe, name, **(env or {}))
        cmd = [sys.executable, "-m", "ae.cli.launch", f"--output_dir={out}", *args]
        t0 = time.monotonic()
        with open(console, "w") as log:
            proc = subprocess.Popen(
                cmd,
                cwd=ROOT,
                env=run_env,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
            result: dict[str, Any] = {"args": args, "fault": run_env.get("AE_FAULT")}
            try:
                if watch is not None:
                    watch(proc, out)
                result["rc"] = proc.wait(timeout=max(1.0, timeout - (time.monotonic() - t0)))
            except subprocess.TimeoutExpired:
                result["rc"] = None
                result["timed_out_after_s"] = round(timeout)
            finally:
                _kill_run(proc, out)
        result["seconds"] = round(time.monotonic() - t0, 1)
        result["console_tail"] = console.read_text(errors="replace")[-1500:]
        result["probe"] = _probe_results(self.runs, name)
        result["out"] = str(out)
        _say(f"  run {name}: rc={result['rc']} in {result['seconds']} s")
        return result

    def diagnose(self, logs: Path, *flags: str, timeout: float = 60) -> dict[str, Any]:
        res = subprocess.run(
            [sys.executable, "-m", "ae.diagnose", str(logs), *flags],
            cwd=ROOT,
            env=self.env(),
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        out: dict[str, Any] = {"rc": res.returncode}
        if "--json" in flags and res.returncode == 0:
            try:
                out["doc"] = json.loads(res.stdout)
            except json.JSONDecodeError:
                out["stdout_tail"] = res.stdout[-2000:]
        else:
            out["stdout_tail"] = res.stdout[-2000:]
        out["stderr_tail"] = res.stderr[-2000:]
        return out

    # --- artifacts ---------------------------------------------------------------------------
    def pack(self) -> None:
        """Logs, metrics, probe files and consoles of every run (no checkpoints), and the grids,
        into --artifacts."""
        self.artifacts.mkdir(parents=True, exist_ok=True)
        tar_path = self.artifacts / f"{NAME}_logs.tar.gz"
        files = [p for p in self.work.rglob("*") if p.is_file() and _packed(p, self.work)]
        files.sort(key=lambda p: p.stat().st_size)  # a cut, if any, drops the largest
        skipped = []
        with tarfile.open(tar_path, "w:gz") as tar:
            for p in files:
                if tar_path.stat().st_size > 14 * 2**20 or p.stat().st_size > 64 * 2**20:
                    skipped.append(p.name)
                    continue
                tar.add(p, arcname=str(p.relative_to(self.work)))
        grids = {"grid_bf16.png": "resume_bf16-straight", "grid_compile.png": "compile-first"}
        names = [tar_path.name]
        for target, run in grids.items():
            found = sorted((self.runs / run / "samples").glob("*.png"))
            if found:
                shutil.copy(found[-1], self.artifacts / target)
                names.append(target)
        with self.lock:
            self.record["artifacts"] = names
            self.record["artifacts_left_out"] = skipped


def _packed(p: Path, work: Path) -> bool:
    rel = p.relative_to(work).parts
    if rel[0] not in ("runs", "hand_worker.json", "hand_worker.log", "hand_spec.json"):
        return False
    return p.suffix not in (".ckpt", ".tmp") and "checkpoints" not in rel


def _probe_results(runs: Path, name: str) -> dict[str, Any] | None:
    found = {}
    for p in sorted(runs.glob(f"{name}.probe.rank*.json")):
        with contextlib.suppress(OSError, json.JSONDecodeError):
            found[p.name.split(".")[-2]] = json.loads(p.read_text())
    return found.get("rank0") if found else None


def _kill_run(proc: subprocess.Popen, out: Path) -> None:
    """Every process of a run: the launcher's descendants, and any whose command line names the
    run's folder (ranks run in sessions of their own)."""
    import psutil

    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    victims = []
    with contextlib.suppress(psutil.Error):
        victims += psutil.Process(proc.pid).children(recursive=True)
    for p in psutil.process_iter(["cmdline"]):
        if any(str(out) in arg for arg in p.info["cmdline"] or []):
            victims.append(p)
    for p in victims:
        with contextlib.suppress(psutil.Error):
            p.kill()
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=10)


def _say(text: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {text}", flush=True)


def _gpu_present() -> bool:
    """Without importing torch here (this process leaves the GPU to the runs)."""
    if shutil.which("nvidia-smi") is None:
        return False
    with contextlib.suppress(OSError, subprocess.TimeoutExpired):
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30)
        return out.returncode == 0 and "GPU " in out.stdout
    return False


def _device_info() -> dict[str, Any]:
    import importlib.metadata
    import platform

    info: dict[str, Any] = {"python": platform.python_version(), "cpus": os.cpu_count()}
    for pkg in ("torch", "lightning", "loguru", "webdataset", "numpy"):
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            info[pkg] = importlib.metadata.version(pkg)
    if shutil.which("nvidia-smi"):
        q = "name,memory.total,driver_version,clocks.max.sm,power.limit"
        with contextlib.suppress(OSError, subprocess.TimeoutExpired):
            res = subprocess.run(
                ["nvidia-smi", f"--query-gpu={q}", "--format=csv,noheader"],
                capture_output=True,
                text=True,
                timeout=30,
            )
            info["gpu"] = res.stdout.strip()
    return info


class Utilisation:
    """NVML's GPU utilisation (percent of time a kernel ran), every 0.1 s, by `nvidia-smi`."""

    def __init__(self, enabled: bool) -> None:
        self.samples: list[tuple[float, float]] = []
        self.proc: subprocess.Popen[str] | None = None
        if not enabled:
            return
        self.proc = subprocess.Popen(
            [
                "nvidia-smi",
                "--query-gpu=utilization.gpu",
                "--format=csv,noheader,nounits",
                "-i",
                "0",
                "-lms",
                "100",
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        for line in self.proc.stdout:
            with contextlib.suppress(ValueError):
                self.samples.append((time.time(), float(line.strip())))

    def mean(self, window: dict[str, float] | None) -> float | None:
        if not window:
            return None
        values = [v for t, v in self.samples if window["t0"] <= t <= window["t1"]]
        return sum(values) / len(values) if values else None

    def close(self) -> None:
        if self.proc is not None:
            self.proc.terminate()


# =============================================================================================
# Sizes and flags
# =============================================================================================


def sizes(quick: bool) -> SimpleNamespace:
    if quick:
        return SimpleNamespace(
            vec_shards=2,
            vec_per_shard=8192,
            photo_copies=4,
            image_flags=["--image_size=16"],
            mlp_batches=(512, 4096),
            resnet_batch=32,
            resnet=[
                "--model=resnet",
                "--downsample=8",
                "--base_channels=8",
                "--channel_mult=1,2,2,2",
                "--res_blocks=1",
            ],
            windows=dict(warmup=5, seconds=3.0, min_steps=5, profile=4, sync=12),
            hand_windows=dict(warmup=5, seconds=2.0, min_steps=5, profile=0),
            workers=1,
            resident_images=512,
            oom_sample_batch=64,
            stall_step=6,
            stall_secs=8,
            stall_timeout=2,
            correctness_batch=32,
        )
    return SimpleNamespace(
        vec_shards=32,
        vec_per_shard=131072,
        photo_copies=40,
        image_flags=[],
        mlp_batches=(4096, 65536),
        resnet_batch=128,
        resnet=["--model=resnet", "--downsample=8"],  # the defaults: base 64, 1,2,4,4, 2 blocks
        windows=dict(warmup=30, seconds=6.0, min_steps=20, profile=20, sync=100),
        hand_windows=dict(warmup=30, seconds=5.0, min_steps=20, profile=20),
        workers=6,
        resident_images=4096,
        oom_sample_batch=4096,
        stall_step=15,
        stall_secs=16,
        stall_timeout=4,
        correctness_batch=32,
    )


# =============================================================================================
# The parts
# =============================================================================================


def _vec_samples(a: Any, first: int, arr: Any) -> Iterator[dict[str, bytes]]:
    return (
        {"__key__": f"{first + j:09d}".encode(), "npy": a.npy_bytes(row)}
        for j, row in enumerate(arr)
    )


def fast_vec_shard(a: Any, path: Path, first: int, arr: Any) -> None:
    """The shard ae's writer makes of `arr` (keys first.. as 9 digits, one `npy` member each),
    built as whole arrays: every member's header is the writer's own header of the first
    sample with the name and checksum replaced (ae's writer: ~40 us a sample; this: ~0.1 us).
    `check_fast_writer` compares the bytes with ae's writer."""
    import numpy as np

    n = len(arr)
    probe = path.with_name(f".probe-{path.name}")
    a.write_shard(probe, _vec_samples(a, first, arr[:1]))
    raw = probe.read_bytes()
    for p in probe.parent.glob(f"{probe.name}*"):
        p.unlink()
    npy = a.npy_bytes(arr[0])
    assert len(npy) <= 512 and len(npy) - arr[0].nbytes == 128, "one 512-byte block a sample"
    headers = np.tile(np.frombuffer(raw[:512], np.uint8), (n, 1))
    keys = np.arange(first, first + n, dtype=np.int64)[:, None]
    headers[:, :9] = keys // 10 ** np.arange(8, -1, -1) % 10 + ord("0")
    headers[:, 148:156] = ord(" ")  # the checksum counts its own field as spaces
    chk = headers.sum(axis=1, dtype=np.int64)[:, None]
    headers[:, 148:154] = chk // 8 ** np.arange(5, -1, -1) % 8 + ord("0")
    headers[:, 154], headers[:, 155] = 0, ord(" ")
    data = np.zeros((n, 512), np.uint8)
    data[:, :128] = np.frombuffer(npy[:128], np.uint8)
    data[:, 128 : 128 + arr[0].nbytes] = np.ascontiguousarray(arr).view(np.uint8).reshape(n, -1)
    body = np.concatenate([headers, data], axis=1).tobytes() + bytes(1024)
    body += bytes(-len(body) % 10240)  # tarfile pads the archive to its 20-block records
    tmp = path.with_name(f".tmp-{path.name}")
    tmp.write_bytes(body)
    tmp.replace(path)
    a.write_index(path, n, list(range(0, n * 1024, 1024)))


def check_fast_writer(a: Any, root: Path) -> bool:
    """`fast_vec_shard` and ae's writer give the same bytes (shard and index sidecar)."""
    arr = vec_array(7, 300)
    root.mkdir(parents=True, exist_ok=True)
    a.write_shard(root / "ae.tar", _vec_samples(a, 5000, arr))
    fast_vec_shard(a, root / "fast.tar", 5000, arr)
    same = (root / "ae.tar").read_bytes() == (root / "fast.tar").read_bytes()
    idx = [(root / f"{n}.tar.idx").read_text() for n in ("ae", "fast")]
    shutil.rmtree(root)
    return same and idx[0] == idx[1]


def _write_vec_shard(out: str, i: int, per_shard: int, fast: bool) -> None:
    a = _ae()
    path, arr = Path(out) / f"vec-{i:06d}.tar", vec_array(i, per_shard)
    if fast:
        fast_vec_shard(a, path, i * per_shard, arr)
    else:
        a.write_shard(path, _vec_samples(a, i * per_shard, arr))


_CROPS: list[Any] = []  # the photo crops, shared with forked shard writers


def _write_photo_shard(path: str, start: int, indices: list[int]) -> None:
    a = _ae()
    samples = (
        {"__key__": f"{start + j:09d}".encode(), "png": a.png_bytes(_CROPS[k])}
        for j, k in enumerate(indices)
    )
    a.write_shard(Path(path), samples)


def _pool(jobs: list[tuple], fn: Callable) -> None:
    import multiprocessing

    with multiprocessing.get_context("fork").Pool(min(len(jobs), os.cpu_count() or 1)) as pool:
        pool.starmap(fn, jobs)


def part_data(p: Proof, z: SimpleNamespace) -> None:
    a = p.a
    data = p.work / "data"
    t0 = time.monotonic()
    vec = data / f"vec-{z.vec_shards}x{z.vec_per_shard}"
    fast = check_fast_writer(a, data / "writer-check")
    if not (vec / "DONE").exists():
        shutil.rmtree(vec, ignore_errors=True)
        vec.mkdir(parents=True)
        jobs = [(str(vec), i, z.vec_per_shard, fast) for i in range(z.vec_shards)]
        _pool(jobs, _write_vec_shard)
        (vec / "DONE").write_text("")
    p.specs = SimpleNamespace(vec=str(vec / f"vec-{{000000..{z.vec_shards - 1:06d}}}.tar"))
    vec_s = time.monotonic() - t0
    source = _photos(p, a)
    t1 = time.monotonic()
    photos = data / f"photos-x{z.photo_copies}"
    if not (photos / "DONE").exists():
        shutil.rmtree(photos, ignore_errors=True)
        photos.mkdir(parents=True)
        _CROPS.clear()
        split: dict[str, list[int]] = {"train": [], "val": []}
        from PIL import Image

        for path in source["paths"]:
            part = "val" if Path(path).name.removeprefix("skimage_") in a.VAL_PHOTOS else "train"
            with Image.open(path) as im:
                crops = a.photo_crops(im.convert("RGB"), 64)
            split[part] += range(len(_CROPS), len(_CROPS) + len(crops))
            _CROPS.extend(crops)
        train, val = split["train"], split["val"]
        big = train * z.photo_copies
        per = -(-len(big) // 16)
        jobs = [
            (str(photos / f"train-{i:06d}.tar"), i * 144, train[i * 144 : (i + 1) * 144])
            for i in range(-(-len(train) // 144))
        ]
        jobs.append((str(photos / "val-000000.tar"), 10**6, val))
        jobs += [
            (str(photos / f"big-{i:06d}.tar"), 2 * 10**6 + i * per, big[i * per : (i + 1) * per])
            for i in range(16)
            if big[i * per : (i + 1) * per]
        ]
        _pool(jobs, _write_photo_shard)
        (photos / "DONE").write_text(
            json.dumps({"train": len(train), "val": len(val), "big": len(big)})
        )
    counts = json.loads((photos / "DONE").read_text())
    p.specs.train = str(photos / "train-*.tar")
    p.specs.val = str(photos / "val-*.tar")
    p.specs.big = str(photos / "big-*.tar")
    p.put(
        "data",
        "vec",
        {
            "spec": p.specs.vec,
            "samples": z.vec_shards * z.vec_per_shard,
            "dim": DIM,
            "seconds": round(vec_s, 1),
            "fast_writer_same_bytes_as_ae_writer": fast,
        },
    )
    p.put(
        "data",
        "photos",
        {
            "source": source["source"],
            "crops": counts,
            "size": 64,
            "seconds": round(time.monotonic() - t1, 1),
        },
    )


def _photos(p: Proof, a: Any) -> dict[str, Any]:
    """The 20 photographs: `--photos` (a folder that holds them, checked by sha256), else
    `bench.real_images` (an installed scikit-image with the same files, or the pinned wheel
    from PyPI), else whatever scikit-image is installed (other bytes), else nothing."""
    dest = Path(p.args.photos) if p.args.photos else p.work / "photos"
    try:
        return {"paths": [str(x) for x in a.real_photos(dest)], "source": f"pinned ({dest})"}
    except Exception as e:
        spec = importlib.util.find_spec("skimage")
        if spec is None or not spec.submodule_search_locations:
            raise RuntimeError(f"no photographs: {e}") from e
        root = Path(next(iter(spec.submodule_search_locations))) / "data"
        paths = [str(root / n) for n in a.SKIMAGE.images if (root / n).is_file()]
        if len(paths) < 8:
            raise RuntimeError(f"no photographs: {e}; installed skimage has {len(paths)}") from e
        return {"paths": paths, "source": f"installed skimage, unpinned ({root})"}


def _configs(p: Proof, z: SimpleNamespace) -> list[dict[str, Any]]:
    """The throughput configs: the same flags for the hand loop and the launcher."""
    common = [
        "--devices=1",
        "--max_epochs=-1",
        "--max_steps=1000000",
        "--val_shards=none",
        "--checkpointing_period=0",
        "--save_best=false",
        "--sample_period=-1",
        "--sample_every_epoch=false",
        f"--num_workers={z.workers}",
    ]
    vec = {"kind": "vec", "shards": z.vec_shards, "per_shard": z.vec_per_shard}
    out = [
        {
            "name": f"mlp_b{b}",
            "resident": vec,
            "flags": [*common, f"--train_shards={p.specs.vec}", f"--batch_size={b}"],
        }
        for b in z.mlp_batches
    ]
    out.append(
        {
            "name": f"resnet_f8_bf16_b{z.resnet_batch}",
            "resident": {"kind": "image", "n": z.resident_images},
            "flags": [
                *common,
                f"--train_shards={p.specs.big}",
                f"--batch_size={z.resnet_batch}",
                "--precision=bf16-mixed",
                "--shard_split=resampled",
                "--epoch_samples=1000000000",
                *z.resnet,
                *z.image_flags,
            ],
        }
    )
    for c in out:
        c["windows"] = z.hand_windows
        if not p.cuda:
            c["flags"] = [*c["flags"], "--accelerator=cpu"]
    return out


def part_hand(p: Proof, z: SimpleNamespace, configs: list[dict]) -> None:
    spec = p.work / "hand_spec.json"
    out = p.work / "hand_worker.json"
    out.unlink(missing_ok=True)
    spec.write_text(json.dumps({"work": str(p.work), "configs": configs}))
    log = p.work / "hand_worker.log"
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", "hand", str(spec), str(out)]
    with open(log, "w") as f:
        try:
            rc = subprocess.run(
                cmd,
                cwd=ROOT,
                env=p.env(),
                stdout=f,
                stderr=subprocess.STDOUT,
                timeout=p.budget.slot(240 if not p.quick else 300, 200),
            ).returncode
        except subprocess.TimeoutExpired:
            rc = None
    results = json.loads(out.read_text()) if out.exists() else {}
    results["rc"] = rc
    if rc != 0:
        results["log_tail"] = log.read_text(errors="replace")[-3000:]
    with p.lock:
        p.record["hand"] = results
    p.save()


def part_ae_throughput(p: Proof, z: SimpleNamespace, configs: list[dict]) -> None:
    for c in configs:
        name = c["name"]
        probe = {"windows": z.windows, "stop": True, "cadences": [500]}  # progress lines
        want = 150 if "resnet" in name else 90
        res = p.launch(f"tp-{name}", c["flags"], p.budget.slot(want, 150), probe=probe)
        pr = res.pop("probe") or {}
        row = pr.get("throughput") or {}
        if row:
            row["gpu_busy"]["nvml_util_percent"] = p.nvml.mean(row.get("window"))
            row["gpu_busy"].update(_busy(pr.get("profile")))
        hand = p.record["hand"].get(name, {})
        entry = {
            "ae": row or None,
            "ae_profile": pr.get("profile"),
            "ae_run": res,
            "ae_probe_errors": pr.get("errors"),
            "ae_strategy": pr.get("strategy"),
            "hand_resident": hand.get("resident"),
            "hand_ae_loader": hand.get("ae_loader"),
        }
        for side in ("hand_resident", "hand_ae_loader"):
            h = entry[side]
            if h and p.cuda:
                h.setdefault("gpu_busy", {})["nvml_util_percent"] = p.nvml.mean(h.get("window"))
                h["gpu_busy"].update(_busy(h.get("profile")))
        entry["ratios"] = _ratios(entry)
        p.put("throughput", name, entry)
        p.put("sync_check", name, pr.get("sync") or {"missing": "no sync window in the probe"})
    _targets(p)


def _busy(profile: dict | None) -> dict[str, Any]:
    if not profile or "kernel_share" not in profile:
        return {"kernel_share": None}
    return {
        "kernel_share": profile["kernel_share"],
        "kernel_ms_per_step": profile["kernel_ms_per_step"],
    }


def _ratios(entry: dict) -> dict[str, float | None]:
    def rate(side: str) -> float | None:
        return (entry.get(side) or {}).get("samples_per_s")

    ae, res, ldr = rate("ae"), rate("hand_resident"), rate("hand_ae_loader")
    return {
        "ae_vs_hand_resident": ae / res if ae and res else None,
        "ae_vs_hand_ae_loader": ae / ldr if ae and ldr else None,
        "hand_ae_loader_vs_resident": ldr / res if ldr and res else None,
    }


def _targets(p: Proof) -> None:
    tp = p.record["throughput"]
    out = {}
    resnet = next((v for k, v in tp.items() if k.startswith("resnet")), None)
    if resnet:
        r = resnet["ratios"]["ae_vs_hand_resident"]
        out["resnet_ae_vs_hand_ge_0.9"] = {
            "value": r,
            "met": None if r is None else r >= 0.9,
            "vs": "hand loop with every sample on the GPU",
        }
    big = max((k for k in tp if k.startswith("mlp_b")), key=lambda k: int(k[5:]), default=None)
    if big:
        busy = (tp[big].get("ae") or {}).get("gpu_busy", {})
        share = busy.get("kernel_share")
        out[f"{big}_gpu_busy_ge_0.8"] = {
            "value": share,
            "met": None if share is None else share >= 0.8,
            "measure": "union of CUDA kernel time / wall, 20 profiled steps (torch.profiler)",
            "nvml_util_percent": busy.get("nvml_util_percent"),
            "in_step_share_events": busy.get("in_step_share_events"),
        }
    with p.lock:
        p.record["targets"] = out
    p.save()


def part_oom(p: Proof, z: SimpleNamespace) -> None:
    """A real CUDA OOM at sampling (GPU); on the CPU the injected one (`oom@sampling`)."""
    period = 6
    args = [
        f"--train_shards={p.specs.big}",
        "--val_shards=none",
        "--devices=1",
        f"--batch_size={z.correctness_batch}",
        "--precision=bf16-mixed",
        *z.resnet,
        *z.image_flags,
        "--max_epochs=1",
        f"--max_steps={2 * period + 2}",
        f"--sample_period={period}",
        f"--sample_batch_size={z.oom_sample_batch}",
        "--num_sample_batches=1",
        "--sample_every_epoch=false",
        "--checkpointing_period=0",
        "--save_best=false",
        "--num_workers=2",
        "--debug=true",
    ]
    if p.cuda:
        probe: dict[str, Any] | None = {
            "ballast": {"step": period - 1, "leave_mb": p.args.oom_leave_mb}
        }
        env = {}
        how = f"real: all GPU memory but {p.args.oom_leave_mb} MB taken before step {period}"
    else:
        probe, env = None, {"AE_FAULT": f"oom@sampling:step={period}"}
        args.append("--accelerator=cpu")
        how = "skipped: no CUDA -- the injected OOM (AE_FAULT=oom@sampling) instead"
    res = p.launch("oom", args, p.budget.slot(120, 100), probe=probe, env=env)
    logs = Path(res["out"]) / "logs"
    text = _read_logs(logs, "debug_rank0_*.log")
    ooms = [m for line in text.splitlines() if (m := p.a.SAMPLING_OOM.parse(line))]
    ends = [m for line in text.splitlines() if (m := p.a.SAMPLING_END.parse(line))]
    train = _read_logs(logs, "train_*.log")
    result = {
        "how": how,
        "rc": res["rc"],
        "seconds": res["seconds"],
        "survived": res["rc"] == 0 and "Training finished" in train,
        "sampling_oom": ooms,
        "sampling_end": ends,
        "ballast": ((res.get("probe") or {}).get("ballast")),
        "halved": [int(m["batch_size"]) for m in ooms],
        "real_cuda_oom": any(
            "CUDA out of memory" in m["error"] and "injected" not in m["error"] for m in ooms
        ),
        "console_tail": res["console_tail"] if res["rc"] != 0 else None,
    }
    p.put("faults", "sampling_oom", result)


def _read_logs(logs: Path, pattern: str) -> str:
    return "".join(f.read_text(errors="replace") for f in sorted(logs.glob(pattern)))


STEP_LOSS = re.compile(r"\] Training step (\d+), loss=(\S+?)[,\s]")


def _step_losses(out: Path) -> dict[int, str]:
    losses: dict[int, str] = {}
    for log in sorted((out / "logs").glob("debug_rank0_*.log")):
        losses.update({int(s): v for s, v in STEP_LOSS.findall(log.read_text(errors="replace"))})
    return losses


def _run_files(out: Path) -> dict[str, Any]:
    ckpts = sorted(p.name for p in (out / "checkpoints").glob("*.ckpt"))
    return {
        "checkpoints": ckpts,
        "grids": sorted(p.name for p in (out / "samples").glob("*.png")),
        "metrics_rows": sum(
            max(0, len(p.read_text().splitlines()) - 1)
            for p in (out / "metrics").glob("*/metrics.csv")
        ),
        "logs": sorted(p.name.split("_")[0] for p in (out / "logs").glob("*.log")),
    }


def _weights_diff(a_ckpt: Path, b_ckpt: Path) -> dict[str, Any]:
    import torch

    a = torch.load(a_ckpt, map_location="cpu", weights_only=False)
    b = torch.load(b_ckpt, map_location="cpu", weights_only=False)
    sa, sb = a["state_dict"], b["state_dict"]
    diffs = {
        k: (sa[k].float() - sb[k].float()).abs().max().item()
        for k in sa
        if k in sb and sa[k].is_floating_point()
    }
    worst = max(diffs, key=diffs.get) if diffs else None
    return {
        "tensors": len(diffs),
        "identical": all(v == 0 for v in diffs.values()),
        "max_abs_diff": diffs[worst] if worst else None,
        "worst": worst,
        "global_step": [a.get("global_step"), b.get("global_step")],
        "dtypes": sorted({str(t.dtype) for t in sa.values() if hasattr(t, "dtype")}),
    }


def _compare_losses(straight: dict[int, str], resumed: dict[int, str]) -> dict[str, Any]:
    common = sorted(set(straight) & set(resumed))
    rel = [
        abs(float(straight[s]) - float(resumed[s])) / max(abs(float(straight[s])), 1e-12)
        for s in common
    ]
    return {
        "steps_compared": [common[0], common[-1]] if common else None,
        "identical": sum(straight[s] == resumed[s] for s in common),
        "of": len(common),
        "max_rel_diff": max(rel) if rel else None,
    }


def _correctness_args(p: Proof, z: SimpleNamespace, name: str) -> list[str]:
    args = [
        f"--train_shards={p.specs.train}",
        f"--val_shards={p.specs.val}",
        "--devices=1",
        f"--batch_size={z.correctness_batch}",
        "--precision=bf16-mixed",
        *z.resnet,
        *z.image_flags,
        "--checkpointing_period=10",
        "--num_workers=2",
        "--debug=true",
        "--log_every_n_train_batches=1",
        "--sample_batch_size=8",
    ]
    return args if p.cuda else [*args, "--accelerator=cpu"]


def part_resume(p: Proof, z: SimpleNamespace, prefix: str, extra: list[str], slot: float) -> None:
    """2 epochs straight, and 1 epoch then resumed to 2 (`compile`: no straight run: the
    eager one is its reference)."""
    end = time.monotonic() + slot
    args = [*_correctness_args(p, z, prefix), *extra]
    result: dict[str, Any] = {"flags": extra or ["(eager)"]}
    key = prefix.replace("-", "_")
    straight_out = p.runs / "resume_bf16-straight"
    if prefix == "resume_bf16":
        s = p.launch(f"{prefix}-straight", [*args, "--max_epochs=2"], end - time.monotonic())
        result["straight"] = {"rc": s["rc"], "seconds": s["seconds"], **_run_files(straight_out)}
        if s["rc"] != 0:
            result["straight"]["console_tail"] = s["console_tail"]
        p.put("correctness", key, result)
    first = p.launch(f"{prefix}-first", [*args, "--max_epochs=1"], end - time.monotonic())
    first_out = Path(first["out"])
    result["first"] = {"rc": first["rc"], "seconds": first["seconds"], **_run_files(first_out)}
    if first["rc"] != 0:
        result["first"]["console_tail"] = first["console_tail"]
        p.put("correctness", key, result)
        return
    p.put("correctness", key, result)
    # The resumed run continues in the first run's folder, as a user resumes.
    resumed = p.launch(
        f"{prefix}-resumed",
        [*args, "--max_epochs=2", "--resume_from_checkpoint=last"],
        end - time.monotonic(),
        out=first_out,
    )
    result["resumed"] = {
        "rc": resumed["rc"],
        "seconds": resumed["seconds"],
        **_run_files(first_out),
    }
    train = _read_logs(first_out / "logs", "train_*.log")
    result["resumed"]["resumed_line"] = next(
        (line.split("] ", 1)[-1] for line in train.splitlines() if "Resumed from" in line), None
    )
    result["resumed"]["finished_line"] = next(
        (
            line.split("] ", 1)[-1]
            for line in reversed(train.splitlines())
            if "Training finished" in line
        ),
        None,
    )
    if resumed["rc"] != 0:
        result["resumed"]["console_tail"] = resumed["console_tail"]
    if (straight_out / "checkpoints" / "last.ckpt").exists() and resumed["rc"] == 0:
        ref = "straight" if prefix == "resume_bf16" else "eager_straight"  # compiled: not exact
        result[f"losses_vs_{ref}"] = _compare_losses(
            _step_losses(straight_out), _step_losses(first_out)
        )
        result[f"weights_vs_{ref}"] = _weights_diff(
            straight_out / "checkpoints" / "last.ckpt", first_out / "checkpoints" / "last.ckpt"
        )
    p.put("correctness", key, result)


def part_nccl_stall(p: Proof, z: SimpleNamespace, slot: float) -> None:
    """NCCL at world size 1 (forced), its init lines, a kernel that stalls the rank, the STALL
    report, the Flight Recorder dump asked for by ae-diagnose --dump, and the verdicts."""
    a = p.a
    step, secs = z.stall_step, z.stall_secs
    args = [
        f"--train_shards={p.specs.vec}",
        "--val_shards=none",
        "--devices=1",
        f"--batch_size={z.mlp_batches[0]}",
        "--max_epochs=-1",
        f"--max_steps={step + 25}",
        "--num_workers=2",
        "--debug=true",
        f"--stall_timeout={z.stall_timeout}",
        "--checkpointing_period=0",
        "--save_best=false",
    ]
    probe: dict[str, Any] = {"force_ddp": True, "stop": False}
    env: dict[str, str] = {}
    if not p.cuda:
        args.append("--accelerator=cpu")
        env["AE_FAULT"] = f"sleep@train:step={step}:secs={secs}"
        via = "AE_FAULT sleep@train (CPU: a host sleep in the step, not a kernel)"
    elif "gpusleep" in a.FAULT_ACTIONS:
        env["AE_FAULT"] = f"gpusleep@train:step={step}:secs={secs}"
        via = "AE_FAULT gpusleep@train"
    else:
        probe["gpu_sleep"] = {"step": step, "secs": secs}
        via = "probe: torch.cuda._sleep at the step's start (ae's AE_FAULT has no gpusleep)"
    live: dict[str, Any] = {}

    def watch(proc: subprocess.Popen, out: Path) -> None:
        logs = out / "logs"
        t_end = time.monotonic() + 90
        while time.monotonic() < t_end and proc.poll() is None:
            if "] STALL detected" in _read_logs(logs, "debug_rank0_*.log"):
                break
            time.sleep(0.5)
        else:
            live["no_stall_seen"] = True
            return
        live["stall_seen_after_s"] = round(time.monotonic() - t0, 1)
        t1 = time.monotonic()
        live["dump"] = p.diagnose(logs, "--dump", timeout=60)
        live["dump"]["seconds"] = round(time.monotonic() - t1, 1)
        live["diagnose_json"] = _verdict(p.diagnose(logs, "--json"))
        live["still_stalled_after_checks"] = proc.poll() is None and not any(
            a.STALL_RESOLVED.parse(line)
            for line in _read_logs(logs, "debug_rank0_*.log").splitlines()
        )

    t0 = time.monotonic()
    res = p.launch("nccl_stall", args, slot, probe=probe, env=env, watch=watch)
    logs = Path(res["out"]) / "logs"
    debug = _read_logs(logs, "debug_rank0_*.log")
    native = _read_logs(logs, "native_rank0_*.log")
    nccl = [line for line in native.splitlines() if "NCCL INFO" in line]
    pr = res.get("probe") or {}
    p.put(
        "correctness",
        "nccl",
        {
            "backend": "nccl" if p.cuda else "skipped: no CUDA (gloo)",
            "strategy": pr.get("strategy"),
            "forced": "the probe replaced Lightning's strategy='auto' by DDPStrategy (ae makes no "
            "process group at world size 1)",
            "nccl_info_lines": len(nccl),
            "nccl_init_lines": [x for x in nccl if "Init" in x or "version" in x][:12],
            "init_complete": any("Init COMPLETE" in x for x in nccl),
            "c10d_lines": [x for x in native.splitlines() if "c10d" in x or "ProcessGroup" in x][
                :8
            ],
            "collectives": _collectives(logs),
            "dump_console": live.get("dump"),
        },
    )
    stall_lines = [m for line in debug.splitlines() if (m := a.STALL.parse(line))]
    report = _stall_report(debug)
    p.put(
        "faults",
        "gpu_stall",
        {
            "via": via,
            "fault_step": step,
            "kernel_secs": secs,
            "rc": res["rc"],
            "seconds": res["seconds"],
            "stall_timeout": z.stall_timeout,
            "stall_lines": stall_lines[:3],
            "resolved": [m for line in debug.splitlines() if (m := a.STALL_RESOLVED.parse(line))][
                :2
            ],
            "fault_injected": [
                m for line in debug.splitlines() if (m := a.FAULT_INJECTED.parse(line))
            ],
            "report_head": report[:10],
            "main_thread_stack": _main_stack(report),
            "live": {k: v for k, v in live.items() if k != "dump"},
            "after": _verdict(p.diagnose(logs, "--json")),
            "probe_gpu_sleep": pr.get("gpu_sleep"),
            "console_tail": res["console_tail"] if res["rc"] != 0 else None,
        },
    )


def _verdict(d: dict[str, Any]) -> dict[str, Any]:
    doc = d.get("doc")
    if not doc:
        return d
    return {
        "status": doc.get("status"),
        "culprits": [
            {k: c.get(k) for k in ("rank", "phase", "cause")}
            | {"evidence": [e.get("text") for e in c.get("evidence", [])][:6]}
            for c in doc.get("culprits", [])
        ],
        "victims": [(v.get("rank"), v.get("cause")) for v in doc.get("victims", [])],
        "ranks": [
            {k: r.get(k) for k in ("rank", "state", "step", "alive", "stall_reports")}
            for r in doc.get("ranks", [])
        ],
    }


def _stall_report(debug: str) -> list[str]:
    lines = debug.splitlines()
    start = next((i for i, x in enumerate(lines) if "STALL report 1:" in x), None)
    return [] if start is None else lines[start : start + 200]


def _main_stack(report: list[str]) -> list[str]:
    start = next((i for i, x in enumerate(report) if x.startswith("Thread MainThread")), None)
    if start is None:
        return []
    stack = []
    for x in report[start + 1 :]:
        if x.startswith("Thread "):
            break
        stack.append(x)
    return stack[-24:]


def _collectives(logs: Path) -> list[dict[str, Any]]:
    out = []
    for f in sorted(logs.glob("collectives_rank*.json")):
        try:
            doc = json.loads(f.read_text())
        except (OSError, json.JSONDecodeError) as e:
            out.append({"file": f.name, "error": str(e)})
            continue
        recorders: dict[str, int] = {}
        ops: dict[str, int] = {}
        for e in doc.get("entries", []):
            recorders[e.get("recorder", "?")] = recorders.get(e.get("recorder", "?"), 0) + 1
            op = str(e.get("profiling_name") or e.get("op") or "?")
            ops[op] = ops.get(op, 0) + 1
        out.append(
            {
                "file": f.name,
                "reason": doc.get("reason"),
                "entries": len(doc.get("entries", [])),
                "recorders": recorders,
                "ops": ops,
                "bytes": f.stat().st_size,
            }
        )
    return out


def part_correctness(p: Proof, z: SimpleNamespace) -> None:
    """resume_bf16, compile and nccl_stall side by side (each its own processes; the GPU is
    shared by time slices), in what is left of the budget."""
    slot = p.budget.slot(420, 15)
    chains: dict[str, Callable[[], None]] = {
        "resume_bf16": lambda: part_resume(p, z, "resume_bf16", [], slot),
        "nccl_stall": lambda: part_nccl_stall(p, z, slot),
    }
    if p.cuda:
        chains["compile"] = lambda: part_resume(p, z, "compile", ["--compile=true"], slot)
    else:
        p.put("skipped", "compile", "--quick / no CUDA: compiling takes minutes on a CPU")

    def run(name: str, fn: Callable[[], None]) -> None:
        t0 = time.monotonic()
        try:
            fn()
        except Exception:
            p.put("errors", name, traceback.format_exc())
        p.put("part_seconds", name, round(time.monotonic() - t0, 1))

    threads = [threading.Thread(target=run, args=item, name=item[0]) for item in chains.items()]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


# =============================================================================================


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="CPU smoke run of every part")
    ap.add_argument("--work", default=None, help="shards and runs (default /tmp/ae-gpu-proof)")
    ap.add_argument(
        "--artifacts",
        default=None,
        help="logs tarball and grids (default: <results>/gpu_proof_files[_quick])",
    )
    ap.add_argument("--photos", default=None, help="a folder holding the 20 photographs")
    ap.add_argument(
        "--budget_s", type=float, default=None, help="whole run (default 430; quick 600)"
    )
    ap.add_argument("--oom_leave_mb", type=float, default=1024)
    ap.add_argument("--parts", default="data,hand,ae,oom,correctness")
    ap.add_argument("--worker", nargs=3, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        hand_worker(Path(args.worker[1]), Path(args.worker[2]))
        os._exit(0)  # persistent loader workers and CUDA teardown: nothing left to wait for
    a = _ae()
    args.work = args.work or ("/tmp/ae-gpu-proof" + ("-quick" if args.quick else ""))
    args.artifacts = args.artifacts or str(
        a.results_dir() / f"{NAME}_files{'_quick' if args.quick else ''}"
    )
    args.budget_s = args.budget_s or (600.0 if args.quick else 430.0)
    p = Proof(args, a)
    if not p.cuda and not args.quick:
        sys.exit("bench.gpu_proof needs a CUDA GPU (nvidia-smi sees none); --quick runs on the CPU")
    z = sizes(args.quick)
    parts = set(args.parts.split(","))
    _say(
        f"gpu_proof: {'quick (CPU)' if args.quick else 'GPU'}, budget {args.budget_s:.0f} s, "
        f"work {args.work}"
    )
    try:
        p.part("data", lambda: part_data(p, z), 0)
        if p.specs is None:
            return
        configs = _configs(p, z)
        if "hand" in parts:
            p.part("hand", lambda: part_hand(p, z, configs), 60)
        if "ae" in parts:
            p.part("ae", lambda: part_ae_throughput(p, z, configs), 60)
        p.pack()
        if "oom" in parts:
            p.part("oom", lambda: part_oom(p, z), 45)
        if "correctness" in parts:
            p.part("correctness", lambda: part_correctness(p, z), 60)
    finally:
        p.nvml.close()
        with contextlib.suppress(Exception):
            p.pack()
        p.save()
        _summary(p)


def _summary(p: Proof) -> None:
    r = p.record
    _say("---- summary ----")
    for name, e in r["throughput"].items():
        ae, hr = e.get("ae") or {}, e.get("hand_resident") or {}
        busy = (ae.get("gpu_busy") or {}).get("kernel_share")
        rates = [f"{(side.get('samples_per_s') or 0):,.0f}/s" for side in (ae, hr)]
        _say(
            f"{name}: ae {rates[0]}, hand (resident) {rates[1]}, ratio "
            f"{e['ratios'].get('ae_vs_hand_resident')}, ae kernel busy {busy}"
        )
    for name, s in r["sync_check"].items():
        _say(f"sync {name}: {s.get('syncs')} syncs, {s.get('outside_cadence')} outside cadence")
    _say(f"targets: {json.dumps(r['targets'])}")
    for k, v in r["correctness"].items():
        _say(f"{k}: {json.dumps(v, default=str)[:400]}")
    for k, v in r["faults"].items():
        _say(f"{k}: {json.dumps(v, default=str)[:400]}")
    _say(f"errors: {list(r['errors'])}; skipped: {r['skipped']}")


if __name__ == "__main__":
    main()
