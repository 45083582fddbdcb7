"""bench/gpu_proof.py's hand-written PyTorch loop (its own process: `python -m bench.gpu_proof
--worker hand SPEC OUT`): the same model, AdamW, clipping and bf16 autocast as ae, over every
sample resident on the GPU and over ae's own loader."""

from __future__ import annotations

import contextlib
import json
import time
import traceback
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from bench.gpu_data import vec_array
from bench.gpu_runner import ae_names, trainer_names
from bench.gpu_timing import StepRecorder, Windows, kernel_busy


def hand_worker(spec_path: Path, out_path: Path) -> None:
    import torch

    a = SimpleNamespace(**vars(ae_names()), **vars(trainer_names()))
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
