"""bench/gpu_proof.py's measuring tools, used in a rank (by the probe) and in the hand loop: the
phases of a measured run, per-step timing with CUDA events, the profiler's kernel-busy share, and
the capture of synchronizing calls. Only the standard library at import: the probe loads this
module before torch."""

from __future__ import annotations

import statistics
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any

SYNC_WARNING = "synchroniz"  # torch: "called a synchronizing CUDA operation"


class Windows:
    """The phases of a measured run, after each step: warmup (steps) -> timed (seconds, and at
    least `min_steps`) -> profile (steps) -> pyprof (steps) -> sync (steps) -> done. A phase of 0
    is skipped."""

    def __init__(
        self,
        warmup: int,
        seconds: float,
        min_steps: int,
        profile: int,
        sync: int,
        pyprof: int = 0,
    ):
        self.plan = [
            ("warmup", warmup),
            ("timed", seconds),
            ("profile", profile),
            ("pyprof", pyprof),
            ("sync", sync),
        ]
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


def host_profile(prof: Any, steps: int, top: int = 40) -> dict[str, Any]:
    """From a cProfile run of the training thread over `steps` steps: its Python calls a step,
    and the functions that take the most time a step, by own time and by time with callees (us,
    inflated alike by the profiler: read the shares, not the microseconds)."""
    import pstats

    rows = []
    for (path, line, fn), (_, calls, own, cum, _) in pstats.Stats(prof).stats.items():
        where = "/".join(path.split("/")[-2:]) if path != "~" else ""
        rows.append((f"{where}:{line}({fn})", calls / steps, own / steps * 1e6, cum / steps * 1e6))

    def table(key: int) -> list[list]:
        best = sorted(rows, key=lambda r: r[key], reverse=True)[:top]
        return [[name, round(n, 2), round(own, 1), round(cum, 1)] for name, n, own, cum in best]

    return {
        "steps": steps,
        "columns": ["function", "calls per step", "own us per step", "with callees us per step"],
        "calls_per_step": round(sum(r[1] for r in rows), 1),
        "own_us_per_step": round(sum(r[2] for r in rows), 1),
        "top_own": table(2),
        "top_with_callees": table(3),
    }


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
        if "/ae/" in frame and "/bench/gpu_" not in frame:
            return frame
    return stack[-1] if stack else "?"
