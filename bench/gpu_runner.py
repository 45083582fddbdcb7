"""bench/gpu_proof.py's orchestrator: the record (written after every part), the budget, the
launches of the real launcher (with the probe armed), ae-diagnose, the artifacts, the device.
It never initialises CUDA itself: the GPU stays whole for the runs."""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from bench.gpu_probe import MODULE, MODULE_ENV, PROBE_ENV, SITECUSTOMIZE

_AE_SPEC = importlib.util.find_spec("ae")
ROOT = Path(_AE_SPEC.origin).resolve().parent.parent if _AE_SPEC and _AE_SPEC.origin else Path()
NAME = "gpu_proof"


def ae_names() -> SimpleNamespace:
    """Every ae (and bench) name this bench uses, imported here only (their import paths change
    in this one place), but for `trainer_names`."""
    from ae.config import parse_config
    from ae.data.shards.index import write_index
    from ae.data.shards.spec import resolve_shards
    from ae.data.shards.writer import npy_bytes, png_bytes, write_shard
    from ae.forensics.faults import ACTIONS
    from ae.log_lines import FAULT_INJECTED, SAMPLING_END, SAMPLING_OOM, STALL, STALL_RESOLVED
    from bench.common import results_dir, write_record
    from bench.models_bench import VAL_PHOTOS, photo_crops
    from bench.real_images import SKIMAGE, real_photos

    return SimpleNamespace(
        parse_config=parse_config,
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
        results_dir=results_dir,
        write_record=write_record,
        VAL_PHOTOS=VAL_PHOTOS,
        photo_crops=photo_crops,
        SKIMAGE=SKIMAGE,
        real_photos=real_photos,
    )


def trainer_names() -> SimpleNamespace:
    """The names that import torch and Lightning (~4.5 s of CPU): the hand loop's process only,
    not the orchestrator."""
    from ae.data.datamodule import ShardDataModule
    from ae.training.model_build import build_model

    return SimpleNamespace(ShardDataModule=ShardDataModule, build_model=build_model)


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
        # --quick: the nccl_stall chain's stall rides in the throughput launch (one launch less,
        # ~9 s of CPU); that run, for the chain's report
        self.stall_in_throughput = False
        self.stall_run: SimpleNamespace | None = None

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
            say(f"{name}: skipped (out of time)")
            return
        say(f"{name}: start ({self.budget.left():.0f} s left)")
        t0 = time.monotonic()
        try:
            fn()
        except Exception:
            self.put("errors", name, traceback.format_exc())
            say(f"{name}: ERROR\n{traceback.format_exc()}")
        self.put("part_seconds", name, round(time.monotonic() - t0, 1))
        say(f"{name}: done in {time.monotonic() - t0:.0f} s")

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
            env[PROBE_ENV], env[MODULE_ENV] = str(cfg_path), MODULE
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
        say(f"  run {name}: rc={result['rc']} in {result['seconds']} s")
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


def say(text: str) -> None:
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


def read_logs(logs: Path, pattern: str) -> str:
    return "".join(f.read_text(errors="replace") for f in sorted(logs.glob(pattern)))
