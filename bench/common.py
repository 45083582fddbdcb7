"""Shared bench helpers: machine description, JSON records, synthetic shard sets."""

from __future__ import annotations

import glob
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from ae.data.shards.writer import npy_bytes, png_bytes, write_shard

RESULTS = Path(__file__).resolve().parent / "results"


def machine() -> dict[str, Any]:
    torch_version, gpu = _torch_facts()
    return {
        "host": platform.node(),
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch_version,
        "gpu": gpu,
        "date": time.strftime("%Y-%m-%d %H:%M"),
    }


# A GPU's device files (NVIDIA's; AMD's for ROCm; WSL's): without any, torch sees no GPU
GPU_DEVICE_FILES = ("/dev/nvidia*", "/dev/kfd", "/dev/dxg")


def _torch_facts() -> tuple[str, str | None]:
    """torch's version and GPU 0's name, as torch says them. Importing torch costs ~2.5 s of CPU,
    which a bench whose own process never needs it (one that launches runs) would pay for its
    record alone; so where torch is not imported yet and the machine has no GPU device file, the
    version comes from the package's metadata (the same string) and the GPU is None."""
    if "torch" not in sys.modules and not any(glob.glob(p) for p in GPU_DEVICE_FILES):
        from importlib.metadata import version

        return version("torch"), None
    import torch

    return torch.__version__, (torch.cuda.get_device_name(0) if torch.cuda.is_available() else None)


def results_dir() -> Path:
    """Where records go: bench/results, or $AE_BENCH_RESULTS (the quick-mode test's tmp dir)."""
    return Path(os.environ.get("AE_BENCH_RESULTS") or RESULTS)


def write_record(name: str, record: dict[str, Any], *, quick: bool = False) -> Path:
    """`<name>.json`, or `<name>_quick.json` for a `--quick` smoke run, which must not replace
    the figures of a full run."""
    out = results_dir()
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{name}{'_quick' if quick else ''}.json"
    record = {"bench": name, "quick": quick, "machine": machine(), **record}
    path.write_text(json.dumps(record, indent=2))
    return path


def synthetic_shards(
    root: Path, kind: str, shards: int, per_shard: int, dim: int = 64, size: int = 32
) -> list[str]:
    """`shards` tar files of `per_shard` samples: 64-dim float32 .npy, or size x size RGB PNGs.
    Cached: an existing set with the same shape is reused."""
    out = root / f"{kind}-{shards}x{per_shard}"
    urls = [str(out / f"shard-{i:06d}.tar") for i in range(shards)]
    if all(Path(u).exists() for u in urls):
        return urls
    rng = np.random.default_rng(0)
    for i, url in enumerate(urls):
        samples = []
        for j in range(per_shard):
            key = f"{i * per_shard + j:09d}".encode()
            if kind == "npy":
                samples.append(
                    {"__key__": key, "npy": npy_bytes(rng.random(dim, dtype=np.float32))}
                )
            else:
                img = rng.integers(0, 256, (size, size, 3), dtype=np.uint8)
                samples.append({"__key__": key, "png": png_bytes(img)})
        write_shard(Path(url), samples)
    return urls


def tarwriter_shards(root: Path, shards: int, per_shard: int, dim: int = 64) -> list[str]:
    """`shards` tar files of `per_shard` 64-dim float32 `.npy` vectors written by WebDataset's
    own `TarWriter`, each with the index sidecar `ae-shards index` writes. Cached."""
    out = root / f"vec-{shards}x{per_shard}"
    urls = [str(out / f"shard-{i:06d}.tar") for i in range(shards)]
    if all(Path(u + ".idx").exists() for u in urls):
        return urls
    import webdataset as wds  # imports torch (~2 s of CPU): only to write the shards

    from ae.data.shards.index import write_index
    from ae.data.shards.tar_header_count import scan_shard

    out.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    for i, url in enumerate(urls):
        with wds.TarWriter(url) as sink:
            for j in range(per_shard):
                sink.write(
                    {"__key__": f"{i * per_shard + j:09d}", "npy": rng.random(dim, np.float32)}
                )
        scan = scan_shard(url)
        write_index(Path(url), scan.samples, scan.offsets)
    return urls


def photo_shards(root: Path, shards: int, per_shard: int) -> list[str]:
    """`shards` tar files of `per_shard` real-photo JPEGs of 500x400 (`jpg` field), all distinct,
    cut from scikit-image's photographs (`bench.real_images`). Cached like `synthetic_shards`."""
    from bench.real_images import bench_photos

    out = root / f"jpg-{shards}x{per_shard}"
    urls = [str(out / f"shard-{i:06d}.tar") for i in range(shards)]
    if all(Path(u).exists() for u in urls):
        return urls
    photos = bench_photos(root / "photos-500x400", n=shards * per_shard)
    for i, url in enumerate(urls):
        chunk = photos[i * per_shard : (i + 1) * per_shard]
        samples = [
            {"__key__": f"{i * per_shard + j:09d}".encode(), "jpg": p.read_bytes()}
            for j, p in enumerate(chunk)
        ]
        write_shard(Path(url), samples)
    return urls


def tiny_shard_set(root: Path, shards: int, per_shard: int, dim: int = 64) -> str:
    """A brace spec over `shards` small .npy shards with index sidecars (cached on disk)."""
    urls = synthetic_shards(root, "npy", shards, per_shard, dim=dim)
    return str(Path(urls[0]).parent / f"shard-{{000000..{shards - 1:06d}}}.tar")


def one_thread_per_process() -> None:
    """For a `--quick` run: torch in every process this bench starts from now on (the launcher's
    ranks, the workers, spawned jobs) uses one thread, unless OMP_NUM_THREADS is set already.
    The launcher gives one rank all the cores; on a shared 2-core machine their OpenMP threads
    spin against the other processes: a 1-rank run of 120 tiny steps took 21 s of CPU with 2
    threads, 9 s with one (load ~6)."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")


def launch_run(args: list[str], out_dir: Path) -> subprocess.Popen:
    """Start the real launcher (what ./train_ae.sh execs) in its own process group."""
    import shutil
    import sys

    shutil.rmtree(out_dir, ignore_errors=True)
    env = {k: v for k, v in os.environ.items() if k not in ("AE_RUN_TS", "MASTER_PORT")}
    return subprocess.Popen(
        [sys.executable, "-m", "ae.cli.launch", f"--output_dir={out_dir}", *args],
        cwd=Path(__file__).resolve().parent.parent,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
