"""bench/gpu_proof.py's `correctness` part: its chains, run side by side: `resume_bf16` (bf16
straight against 1 epoch then resumed), `compile` (the same with --compile=true), `nccl_stall`
(NCCL at world size 1, a kernel that stalls the rank, the STALL report, the Flight Recorder dump
and the verdicts: the `faults.gpu_stall` record)."""

from __future__ import annotations

import json
import re
import subprocess
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from bench.gpu_runner import Proof, read_logs

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
    train = read_logs(first_out / "logs", "train_*.log")
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
    report, the Flight Recorder dump asked for by ae-diagnose --dump, and the verdicts. --quick:
    the run is the throughput launch, if it carried the stall (`nccl_stall_run`)."""
    s = p.stall_run
    if s is None:
        s = nccl_stall_run(p, z)
        s.res = p.launch("nccl_stall", s.args, slot, probe=s.probe, env=s.env, watch=s.watch)
    _nccl_stall_report(p, z, s)


def nccl_stall_run(p: Proof, z: SimpleNamespace) -> SimpleNamespace:
    """The stall run's flags, probe settings, environment and watcher (its clock starts here)."""
    a = p.a
    step, secs = z.stall_step, z.stall_secs
    extra = ["--debug=true", f"--stall_timeout={z.stall_timeout}"]  # a throughput run has neither
    args = [
        f"--train_shards={p.specs.vec}",
        "--val_shards=none",
        "--devices=1",
        f"--batch_size={z.mlp_batches[0]}",
        "--max_epochs=-1",
        f"--max_steps={step + 25}",
        "--num_workers=2",
        *extra,
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
            if "] STALL detected" in read_logs(logs, "debug_rank0_*.log"):
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
            for line in read_logs(logs, "debug_rank0_*.log").splitlines()
        )

    t0 = time.monotonic()
    return SimpleNamespace(
        args=args, extra=extra, probe=probe, env=env, watch=watch, via=via, live=live
    )


def _nccl_stall_report(p: Proof, z: SimpleNamespace, s: SimpleNamespace) -> None:
    a, res, live, via = p.a, s.res, s.live, s.via
    step, secs = z.stall_step, z.stall_secs
    logs = Path(res["out"]) / "logs"
    debug = read_logs(logs, "debug_rank0_*.log")
    native = read_logs(logs, "native_rank0_*.log")
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
            "run": Path(res["out"]).name,  # --quick: the throughput launch's (tp-...)
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


CHAINS = ("resume_bf16", "compile", "nccl_stall")


def part_correctness(p: Proof, z: SimpleNamespace, chosen: list[str]) -> None:
    """The chosen chains (of resume_bf16, compile, nccl_stall) side by side (each its own
    processes; the GPU is shared by time slices), in what is left of the budget."""
    slot = p.budget.slot(420, 15)
    chains: dict[str, Callable[[], None]] = {
        "resume_bf16": lambda: part_resume(p, z, "resume_bf16", [], slot),
        "nccl_stall": lambda: part_nccl_stall(p, z, slot),
    }
    if p.cuda:
        chains["compile"] = lambda: part_resume(p, z, "compile", ["--compile=true"], slot)
    else:
        p.put("skipped", "compile", "--quick / no CUDA: compiling takes minutes on a CPU")
    for name in [c for c in chains if c not in chosen]:
        p.put("skipped", name, "skipped: --quick" if p.quick else "not in --chains")
        del chains[name]

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
