"""Shared fixtures: tiny real shards, and running the real launcher as a subprocess."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import psutil
import pytest

from ae.shard_writer import Sample, npy_bytes, png_bytes, write_shard

ROOT = Path(__file__).resolve().parent.parent


def vector_samples(n: int, dim: int = 16, start: int = 0, seed: int = 0) -> list[Sample]:
    rng = np.random.default_rng(seed + start)
    return [
        {"__key__": f"{start + i:08d}".encode(), "npy": npy_bytes(rng.random(dim, np.float32))}
        for i in range(n)
    ]


def image_samples(n: int, size: int = 8, start: int = 0) -> list[Sample]:
    rng = np.random.default_rng(start)
    return [
        {
            "__key__": f"{start + i:08d}".encode(),
            "png": png_bytes(rng.integers(0, 256, (size, size), dtype=np.uint8)),
        }
        for i in range(n)
    ]


@pytest.fixture
def make_shards(tmp_path: Path) -> Callable[..., str]:
    """make_shards([10, 10, 3], kind="npy", name="train") -> brace spec of the written shards.
    Sample keys are globally unique and consecutive across the shards."""

    def make(sizes: list[int], kind: str = "npy", name: str = "train", dim: int = 16) -> str:
        out = tmp_path / "shards"
        start = 0
        for i, n in enumerate(sizes):
            samples = vector_samples(n, dim, start) if kind == "npy" else image_samples(n, 8, start)
            write_shard(out / f"{name}-{i:06d}.tar", samples)
            start += n
        return str(out / f"{name}-{{000000..{len(sizes) - 1:06d}}}.tar")

    return make


@dataclass
class RunResult:
    returncode: int
    output: str
    logs: Path

    def log(self, pattern: str) -> list[Path]:
        return sorted(self.logs.glob(pattern))

    def text(self, pattern: str) -> str:
        return "".join(p.read_text() for p in self.log(pattern))


def run_launcher(
    args: list[str], out_dir: Path, env: dict[str, str] | None = None, timeout: float = 240
) -> RunResult:
    """Run the real launcher (`python -m ae.launch`, what ./train_ae.sh execs) to completion."""
    base = {k: v for k, v in os.environ.items() if k not in ("AE_RUN_TS", "MASTER_PORT")}
    full_env = {**base, "AE_CACHE_DIR": str(out_dir.parent / "cache"), **(env or {})}
    proc = subprocess.run(
        [sys.executable, "-m", "ae.launch", f"--output_dir={out_dir}", *args],
        cwd=ROOT,
        env=full_env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    return RunResult(proc.returncode, proc.stdout + proc.stderr, out_dir / "logs")


def run_processes(out_dir: Path) -> list[psutil.Process]:
    """Every process of a run (launcher, torchrun, ranks, dataloader workers): their command
    lines name its output dir. Ranks run in sessions of their own, out of the launcher's group."""
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        if any(str(out_dir) in arg for arg in proc.info["cmdline"] or []):
            found.append(proc)
    return found


@pytest.fixture
def launch(tmp_path: Path) -> Callable[..., RunResult]:
    def run(args: list[str], env: dict[str, str] | None = None, timeout: float = 240) -> RunResult:
        return run_launcher(args, tmp_path / "run", env, timeout)

    return run
