"""bench/gpu_proof.py's sizes and its measuring parts: `hand` (the hand loop's process), `ae`
(the real launcher with the probe: throughput, profile, sync check; the targets), `oom` (a CUDA
out-of-memory at reconstruction sampling)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from bench.gpu_correctness import nccl_stall_run
from bench.gpu_runner import ROOT, Proof, read_logs


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
            windows=dict(warmup=5, seconds=0.5, min_steps=5, profile=4, pyprof=4, sync=12),
            hand_windows=dict(warmup=5, seconds=0.5, min_steps=5, profile=0),
            workers=1,
            resident_images=512,
            oom_sample_batch=64,
            stall_step=6,
            stall_secs=6,
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
        windows=dict(warmup=30, seconds=6.0, min_steps=20, profile=20, pyprof=50, sync=100),
        hand_windows=dict(warmup=30, seconds=5.0, min_steps=20, profile=20),
        workers=6,
        resident_images=4096,
        oom_sample_batch=4096,
        stall_step=15,
        stall_secs=16,
        stall_timeout=4,
        correctness_batch=32,
    )


def throughput_configs(p: Proof, z: SimpleNamespace) -> list[dict[str, Any]]:
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
    if not p.quick:  # the largest batch read by the rank itself (a thread reads ahead on CUDA)
        out.append(variant(out[-1], "w0", ["--num_workers=0"]))
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
    if p.quick:  # the smallest config shows every measure; the others only cost launches
        for c in out[1:]:
            p.put("skipped", f"throughput {c['name']}", "skipped: --quick (one config)")
        out = out[:1]
    return out


def variant(config: dict[str, Any], suffix: str, flags: list[str]) -> dict[str, Any]:
    """`config` with `flags` in place of its own of the same names, named `<name>_<suffix>`."""
    names = {f.split("=")[0] for f in flags}
    kept = [f for f in config["flags"] if f.split("=")[0] not in names]
    return {**config, "name": f"{config['name']}_{suffix}", "flags": kept + flags}


def part_hand(p: Proof, z: SimpleNamespace, configs: list[dict]) -> None:
    spec = p.work / "hand_spec.json"
    out = p.work / "hand_worker.json"
    out.unlink(missing_ok=True)
    spec.write_text(json.dumps({"work": str(p.work), "configs": configs}))
    log = p.work / "hand_worker.log"
    cmd = [sys.executable, "-m", "bench.gpu_proof", "--worker", "hand", str(spec), str(out)]
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
        flags, env, watch = c["flags"], None, None
        stall = None
        if p.stall_in_throughput and p.stall_run is None:  # --quick: the stall rides here
            stall = nccl_stall_run(p, z)  # a stall in the timed window, the probe forcing DDP
            flags, env, watch = [*flags, *stall.extra], stall.env, stall.watch
            probe |= {k: v for k, v in stall.probe.items() if k != "stop"}
            want += z.stall_secs + 60  # the stall, and ae-diagnose --dump and --json meanwhile
        res = p.launch(
            f"tp-{name}", flags, p.budget.slot(want, 150), probe=probe, env=env, watch=watch
        )
        if stall is not None:
            stall.res, p.stall_run = dict(res), stall
        pr = res.pop("probe") or {}
        row = pr.get("throughput") or {}
        if row:
            row["gpu_busy"]["nvml_util_percent"] = p.nvml.mean(row.get("window"))
            row["gpu_busy"].update(_busy(pr.get("profile")))
        hand = p.record["hand"].get(name, {})
        entry = {
            "ae": row or None,
            "ae_profile": pr.get("profile"),
            "ae_host_profile": pr.get("pyprof"),
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
    plain = [k for k in tp if k.startswith("mlp_b") and k[5:].isdigit()]  # not the variants
    big = max(plain, key=lambda k: int(k[5:]), default=None)
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
    text = read_logs(logs, "debug_rank0_*.log")
    ooms = [m for line in text.splitlines() if (m := p.a.SAMPLING_OOM.parse(line))]
    ends = [m for line in text.splitlines() if (m := p.a.SAMPLING_END.parse(line))]
    train = read_logs(logs, "train_*.log")
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
