"""bench/gpu_proof.py's probe, inside each rank of a launched run: a `sitecustomize` (written by
the orchestrator, first on the ranks' PYTHONPATH, armed by GPU_PROOF_PROBE) imports this module
by name (GPU_PROOF_MODULE) and patches Lightning's Trainer as its module is imported (not ae): a
callback that times the steps, profiles, captures syncs, and injects the GPU faults."""

from __future__ import annotations

import importlib.abc
import importlib.util
import json
import os
import sys
import time
import traceback
from collections.abc import Iterator
from pathlib import Path
from typing import Any

# Only the standard library above and in bench.gpu_timing: each rank imports this module at
# start (through the probe's sitecustomize), before ae sends its native output to the log and
# before torch.
from bench.gpu_timing import StepRecorder, SyncCapture, Windows, host_profile, kernel_busy

PROBE_ENV, MODULE_ENV = "GPU_PROOF_PROBE", "GPU_PROOF_MODULE"
MODULE = __name__  # what the sitecustomize imports


SITECUSTOMIZE = '''"""bench/gpu_proof.py's probe, armed in the ranks of a run by GPU_PROOF_PROBE."""
import importlib
import importlib.machinery
import importlib.util
import os
import sys

if os.environ.get("GPU_PROOF_PROBE") and os.environ.get("RANK") is not None:
    # the probe's module by name: the repository root is on the ranks' PYTHONPATH
    importlib.import_module(os.environ["GPU_PROOF_MODULE"]).install_probe()
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
            self._pyprof: Any = None
            self._pyprof_step = 0
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
            elif (edge, phase) == ("start", "pyprof"):
                import cProfile

                self._pyprof, self._pyprof_step = cProfile.Profile(), step
                self._pyprof.enable()  # the training thread (Python >= 3.12: every thread)
            elif (edge, phase) == ("end", "pyprof"):
                self._pyprof.disable()
                self.out["pyprof"] = host_profile(self._pyprof, step - self._pyprof_step)
                self._pyprof = None
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
