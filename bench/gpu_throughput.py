"""Does ae's loader keep a GPU busy? The MLP autoencoder trained from vector shards on CUDA.

Two ways to feed the same model, optimizer and batch size, each for `--seconds`:

- `ceiling`: every sample already on the GPU as one tensor; each step takes a random batch of
  it (`torch.randint` + index, on the GPU): the most the GPU can do with this model;
- `ae, K workers`: the trainer's input pipeline (`ShardStream` through the run's train loader:
  the columnar path, pinned batches, persistent workers, prefetch), each batch copied with
  `non_blocking=True`, for each K of `--workers`.

Reported per way: samples/s (optimizer steps x batch size, after a warm-up), the ratio to the
ceiling, and the GPU utilisation (NVML's percentage of time a kernel ran, sampled every 0.1 s by
`nvidia-smi`; mean over the timed part). Shards: 64-dim float32 `.npy` vectors written by
WebDataset's `TarWriter`, indexed (`bench.common.tarwriter_shards`).

    python -m bench.gpu_throughput            # 8 x 250k samples (4 GB of shards, written once:
                                              # a few minutes), then 20 s per way
    python -m bench.gpu_throughput --quick    # a smoke run: 2 x 4k samples, batch 512, 0.1 s
                                              # per way, one thread
    python -m bench.gpu_throughput --accelerator=cpu   # the same on the CPU (no figure of note)

Needs CUDA: without it, it stops with one line saying so, except `--quick`, which then runs on
the CPU (so that the code keeps running where no GPU is). Writes
bench/results/gpu_throughput.json (`--quick`: gpu_throughput_quick.json).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import torch
from torch import nn

from ae.config import PREFETCH_FACTOR
from ae.data.decoding.decode import SampleDecoder
from ae.data.planning.counts import count_shards
from ae.data.stream.resume import ResumableLoader
from ae.data.stream.shard_stream import ShardStream
from ae.training.models.mlp import mlp_autoencoder
from bench.common import tarwriter_shards, write_record


class Utilisation:
    """`nvidia-smi` sampling GPU 0's utilisation every 0.1 s in the background (not `enabled`:
    on the CPU, no figure)."""

    def __init__(self, enabled: bool = True) -> None:
        self.samples: list[tuple[float, float]] = []
        self.proc: subprocess.Popen[str] | None = None
        exe = shutil.which("nvidia-smi")
        if exe is None or not enabled:
            return
        self.proc = subprocess.Popen(
            [exe, "--query-gpu=utilization.gpu", "--format=csv,noheader,nounits", "-i", "0",
             "-lms", "100"],
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
        )  # fmt: skip
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        for line in self.proc.stdout:
            try:
                self.samples.append((time.perf_counter(), float(line.strip())))
            except ValueError:
                continue

    def mean(self, start: float, end: float) -> float | None:
        values = [v for t, v in self.samples if start <= t <= end]
        return sum(values) / len(values) if values else None

    def close(self) -> None:
        if self.proc is not None:
            self.proc.terminate()


def _model(dim: int, device: torch.device) -> tuple[nn.Module, torch.optim.Optimizer]:
    encoder, decoder = mlp_autoencoder(dim, (256, 128), 16)
    model = nn.Sequential(encoder, decoder).to(device)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def _train(
    batches: Iterator[torch.Tensor],
    dim: int,
    seconds: float,
    meter: Utilisation,
    device: torch.device,
) -> dict[str, float | None]:
    """Steps on `batches` (already on the device or not) for `seconds` after 20 warm-up steps."""
    model, opt = _model(dim, device)
    steps = samples = 0
    start = None
    for i, batch in enumerate(batches):
        x = batch.to(device, non_blocking=True)
        loss = nn.functional.mse_loss(model(x), x)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if i == 20:
            _sync(device)
            start = time.perf_counter()
        elif start is not None:
            steps, samples = steps + 1, samples + len(x)
            if time.perf_counter() - start >= seconds:
                break
    _sync(device)
    assert start is not None, "fewer than 21 batches: use more data or a smaller batch"
    end = time.perf_counter()
    return {
        "samples_per_s": samples / (end - start),
        "steps": steps,
        "gpu_util_percent": meter.mean(start, end),
    }


def _on_device(
    urls: list[str], dim: int, batch: int, device: torch.device
) -> Iterator[torch.Tensor]:
    """Every sample on the device (read once through ae's own stream), then random batches."""
    stream = ShardStream(
        split="bench", urls=urls, counts=count_shards(urls).counts,
        decoder=SampleDecoder((("npy", None),), "vector", (dim,)), batch_size=batch, rank=0,
        world_size=1, num_workers=0, shuffle=False,
    )  # fmt: skip
    data = torch.cat(list(stream)).to(device)
    while True:
        yield data[torch.randint(len(data), (batch,), device=data.device)]


def _ae_batches(urls: list[str], dim: int, batch: int, workers: int) -> Iterator[torch.Tensor]:
    """The trainer's loader, epoch after epoch."""
    stream = ShardStream(
        split="train", urls=urls, counts=count_shards(urls).counts,
        decoder=SampleDecoder((("npy", None),), "vector", (dim,)), batch_size=batch, rank=0,
        world_size=1, num_workers=workers,
    )  # fmt: skip
    loader = ResumableLoader(
        stream, batch_size=None, num_workers=workers, pin_memory=torch.cuda.is_available(),
        persistent_workers=workers > 0, prefetch_factor=PREFETCH_FACTOR if workers else None,
    )  # fmt: skip
    epoch = 0
    while True:
        stream.epoch = epoch
        yield from loader
        epoch += 1


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="small data, 0.1 s per way")
    ap.add_argument("--accelerator", choices=("auto", "cpu", "gpu"), default="auto")
    ap.add_argument("--data", default="/tmp/ae-bench-data")
    ap.add_argument("--batch_size", type=int, help="4096 (--quick: 512)")
    ap.add_argument("--workers", help="worker counts for ae, comma-separated (0,2,4; --quick: 0,2)")
    ap.add_argument("--seconds", type=float, default=20.0)
    args = ap.parse_args()
    args.workers = args.workers or ("0,2" if args.quick else "0,2,4")
    args.batch_size = args.batch_size or (512 if args.quick else 4096)
    cuda = torch.cuda.is_available()
    wants_gpu = args.accelerator == "gpu" or (args.accelerator == "auto" and not args.quick)
    if wants_gpu and not cuda:
        sys.exit("bench.gpu_throughput needs a CUDA GPU, and torch sees none here.")
    device = torch.device("cuda" if cuda and args.accelerator != "cpu" else "cpu")
    print(f"device: {device}", flush=True)
    shards, per_shard = (2, 4096) if args.quick else (8, 250_000)
    seconds = 0.1 if args.quick else args.seconds
    if args.quick:  # on a shared 2-core CPU, torch's second thread spins against other processes
        torch.set_num_threads(1)
    dim = 64
    urls = tarwriter_shards(Path(args.data), shards, per_shard, dim)
    meter = Utilisation(enabled=device.type == "cuda")
    rows = {}
    try:
        ways = {"ceiling": lambda: _on_device(urls, dim, args.batch_size, device)}
        for k in (int(w) for w in args.workers.split(",")):
            ways[f"ae, {k} workers"] = lambda k=k: _ae_batches(urls, dim, args.batch_size, k)
        for name, make in ways.items():
            rows[name] = _train(make(), dim, seconds, meter, device)
            ratio = rows[name]["samples_per_s"] / rows["ceiling"]["samples_per_s"]
            rows[name]["vs_ceiling"] = ratio
            util = rows[name]["gpu_util_percent"]
            print(
                f"{name:>16}: {rows[name]['samples_per_s']:>13,.0f} samples/s "
                f"({ratio:.2f}x the ceiling), GPU utilisation "
                + ("n/a" if util is None else f"{util:.0f}%"),
                flush=True,
            )
    finally:
        meter.close()
    path = write_record(
        "gpu_throughput",
        {
            "device": str(device),
            "batch_size": args.batch_size,
            "samples": shards * per_shard,
            "cpus": os.cpu_count(),
            "load_average": os.getloadavg()[0],
            "rows": rows,
        },
        quick=args.quick,
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
