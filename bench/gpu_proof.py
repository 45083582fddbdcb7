"""Proof on a GPU (issue 40), one script, one JSON: throughput against a hand-written loop, no host
sync in a step, bf16 / compile / NCCL correctness, and GPU faults with their verdicts.

    python -m bench.gpu_proof                 # one GPU: ~7 min (--budget_s), then writes
                                              # gpu_proof.json and --artifacts (logs, grids)
    python -m bench.gpu_proof --quick         # CPU smoke run, ~1 min: one throughput config
                                              # (hand and ae, with the sync check) and the
                                              # nccl_stall chain, whose stall rides in ae's
                                              # throughput launch (one launch, not two); the
                                              # rest `skipped: --quick`, CUDA-only checks
                                              # `skipped: no CUDA`
    python -m bench.gpu_proof --parts data,hand,ae,correctness --chains nccl_stall
                                              # a second run of some parts (data always runs)

Parts (each records its result, or its error, in the JSON as soon as it ends; a part that does
not fit in what is left of --budget_s, or is not in --parts, is recorded as skipped). The
modules: this entry; bench.gpu_runner (the record, launches, artifacts), bench.gpu_data,
bench.gpu_hand (the hand loop's process), bench.gpu_parts (sizes, hand, ae, oom),
bench.gpu_correctness (the chains), bench.gpu_probe and bench.gpu_timing (inside the ranks):

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
- `correctness`: the chains named by --chains (default all three), side by side:
- `resume_bf16`: resnet in bf16-mixed with `--debug`: 2 epochs straight; 1 epoch then
  `--resume_from_checkpoint=last` to 2: per-step losses and final weights compared, checkpoints,
  metrics and grids listed.
- `compile`: the same with `--compile=true`, 1 epoch then resumed to 2 (GPU only).
- `nccl_stall`: one run forced onto DDP with NCCL at world size 1 (the probe swaps Lightning's
  `strategy="auto"`: ae builds no process group for one rank), `--debug`: NCCL's init lines in
  the native log; a CUDA kernel that spins ~16 s at step 15 (`AE_FAULT=gpusleep@train` where ae
  has it, else the probe) -> the STALL report (phase, main thread's stack), `ae-diagnose --dump`
  (Flight Recorder through the NCCL path) and `ae-diagnose --json` live, then the run resolves
  and finishes. On the CPU: gloo and `AE_FAULT=sleep@train`. `--quick`: the stall (6 s at step
  6) rides in `ae`'s throughput run (its timed window; the record's `faults.gpu_stall.run` names
  the run), so the smoke run launches once, not twice.

Writes `gpu_proof.json` (`--quick`: gpu_proof_quick.json) where bench records go
(`$AE_BENCH_RESULTS`), and into --artifacts: `gpu_proof_logs.tar.gz` (every run's logs, metrics,
probe files; no checkpoints), `grid_bf16.png`, `grid_compile.png`.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from pathlib import Path

from bench.gpu_correctness import CHAINS, part_correctness
from bench.gpu_data import part_data
from bench.gpu_hand import hand_worker
from bench.gpu_parts import (
    part_ae_throughput,
    part_hand,
    part_oom,
    sizes,
    throughput_configs,
    variant,
)
from bench.gpu_runner import NAME, Proof, ae_names, say

PARTS = ("data", "hand", "ae", "oom", "correctness")
# --quick (the suite's smoke run): every measure once, in a hand loop's process and one launch
# (ae's throughput run carries the nccl_stall chain's stall)
QUICK_PARTS = ("data", "hand", "ae", "correctness")
QUICK_CHAINS = ("nccl_stall",)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--quick", action="store_true", help="CPU smoke run: every measure once (~1 min)"
    )
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
    ap.add_argument(
        "--parts",
        default=None,
        help=f"of {','.join(PARTS)} (default all; quick: all but oom); data always runs",
    )
    ap.add_argument(
        "--chains",
        default=None,
        help=f"correctness chains, of {','.join(CHAINS)} (default all; quick: nccl_stall)",
    )
    ap.add_argument(
        "--configs",
        default=None,
        help="throughput configs by name, comma-separated (default all: mlp_b4096, mlp_b65536, "
        "mlp_b65536_w0, resnet_f8_bf16_b128)",
    )
    ap.add_argument(
        "--variants",
        default=None,
        help="more configs, each the largest MLP config with other flags: "
        "'w12:--num_workers=12;compile:--compile=true,--num_workers=12' adds mlp_b65536_w12 "
        "and mlp_b65536_compile",
    )
    ap.add_argument("--worker", nargs=3, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        hand_worker(Path(args.worker[1]), Path(args.worker[2]))
        os._exit(0)  # persistent loader workers and CUDA teardown: nothing left to wait for
    parts = _chosen(ap, "--parts", args.parts, PARTS, QUICK_PARTS if args.quick else PARTS)
    chains = _chosen(ap, "--chains", args.chains, CHAINS, QUICK_CHAINS if args.quick else CHAINS)
    a = ae_names()
    args.work = args.work or ("/tmp/ae-gpu-proof" + ("-quick" if args.quick else ""))
    args.artifacts = args.artifacts or str(
        a.results_dir() / f"{NAME}_files{'_quick' if args.quick else ''}"
    )
    args.budget_s = args.budget_s or (600.0 if args.quick else 430.0)
    p = Proof(args, a)
    p.stall_in_throughput = (
        args.quick and {"ae", "correctness"} <= set(parts) and ("nccl_stall" in chains)
    )
    if not p.cuda and not args.quick:
        sys.exit("bench.gpu_proof needs a CUDA GPU (nvidia-smi sees none); --quick runs on the CPU")
    z = sizes(args.quick)
    given = args.parts is not None
    for name in [x for x in PARTS if x != "data" and x not in parts]:
        p.put("skipped", name, "not in --parts" if given or not args.quick else "skipped: --quick")
    say(
        f"gpu_proof: {'quick (CPU)' if args.quick else 'GPU'}, budget {args.budget_s:.0f} s, "
        f"work {args.work}"
    )
    try:
        p.part("data", lambda: part_data(p, z), 0)
        if p.specs is None:
            return
        configs = throughput_configs(p, z)
        plain = [c for c in configs if c["name"].startswith("mlp_b") and c["name"][5:].isdigit()]
        for spec in filter(None, (args.variants or "").split(";")):
            suffix, _, flags = spec.partition(":")
            configs.append(variant(plain[-1], suffix, flags.split(",")))
        if args.configs:
            chosen = args.configs.split(",")
            if unknown := set(chosen) - {c["name"] for c in configs}:
                ap.error(
                    f"--configs: unknown {sorted(unknown)}; known: {[c['name'] for c in configs]}"
                )
            configs = [c for c in configs if c["name"] in chosen]
        if "hand" in parts:
            p.part("hand", lambda: part_hand(p, z, configs), 60)
        if "ae" in parts:
            p.part("ae", lambda: part_ae_throughput(p, z, configs), 60)
        p.pack()
        if "oom" in parts:
            p.part("oom", lambda: part_oom(p, z), 45)
        if "correctness" in parts:
            p.part("correctness", lambda: part_correctness(p, z, chains), 60)
    finally:
        p.nvml.close()
        with contextlib.suppress(Exception):
            p.pack()
        p.save()
        _summary(p)


def _chosen(
    ap: argparse.ArgumentParser, flag: str, value: str | None, known: tuple, default: tuple
) -> list[str]:
    chosen = value.split(",") if value else list(default)
    if unknown := [x for x in chosen if x not in known]:
        ap.error(f"{flag}: unknown {unknown}; known: {','.join(known)}")
    return chosen


def _summary(p: Proof) -> None:
    r = p.record
    say("---- summary ----")
    for name, e in r["throughput"].items():
        ae, hr = e.get("ae") or {}, e.get("hand_resident") or {}
        busy = (ae.get("gpu_busy") or {}).get("kernel_share")
        rates = [f"{(side.get('samples_per_s') or 0):,.0f}/s" for side in (ae, hr)]
        say(
            f"{name}: ae {rates[0]}, hand (resident) {rates[1]}, ratio "
            f"{e['ratios'].get('ae_vs_hand_resident')}, ae kernel busy {busy}"
        )
    for name, s in r["sync_check"].items():
        say(f"sync {name}: {s.get('syncs')} syncs, {s.get('outside_cadence')} outside cadence")
    say(f"targets: {json.dumps(r['targets'])}")
    for k, v in r["correctness"].items():
        say(f"{k}: {json.dumps(v, default=str)[:400]}")
    for k, v in r["faults"].items():
        say(f"{k}: {json.dumps(v, default=str)[:400]}")
    say(f"errors: {list(r['errors'])}; skipped: {r['skipped']}")


if __name__ == "__main__":
    main()
