"""Models on real photos: `conv` vs `resnet` at f=8 and f=4, and `--compile` vs eager.

    .venv/bin/python -m bench.models_bench                 # both parts (a few minutes on one GPU)
    .venv/bin/python -m bench.models_bench --part quality  # or: --part compile
    .venv/bin/python -m bench.models_bench --part grids    # the comparison PNG of the last runs
    .venv/bin/python -m bench.models_bench --quick         # a smoke run (CPU without a GPU)

Data: 64x64 RGB crops of the 20 photographs in the scikit-image wheel (`bench.real_images`; the
shorter side resized to 64 at three zooms, six crop positions, mirrored: 36 crops a photo,
`photo_crops`), made here with Pillow and written with `ae.data.shards.writer`. The photos are
split, not the crops: 16 photos train (576 crops), 4 others validate (144 crops: coffee, coins,
gravel, rocket).

`quality`: each model trains through the real launcher (1 process, batch 32, the default AdamW,
LR 1e-3 with 50 warmup steps and cosine decay) for the same number of epochs, so the same steps;
pairs have the same latent size (256 numbers: conv --latent_dim=256 vs resnet f=8 with 4 latent
channels; 1024: --latent_dim=1024 vs resnet f=4) and similar parameter counts. The table has the
final validation MSE / PSNR / SSIM (the run's metrics.csv); the runs' grids are kept, and
`comparison.png` puts 8 validation crops (2 per held-out photo) over every model's
reconstructions, from the final checkpoints.

`compile`: a small resnet f=8 (`COMPILE_MODEL`: base 8 channels, the crops resized to 16x16,
batch 16), eager and with `--compile=true`, `--compile_epochs` each; steps/s is the trainer's own
rate line of the last epoch (epoch 0 carries the compilation itself). `--accelerator=cpu`
measures it on the CPU.

`--quick`: one epoch over the first train shard (144 crops) of the first model (conv, latent 256:
one launch, which runs every step of the bench that a model does) and its grid, the crops taken
to 16x16 (`QUICK_SIZE`: a step at 64x64 takes seconds on a shared CPU), no `compile` part
(compiling takes minutes on a CPU); the accelerator is the launcher's `auto` (the CPU where no
GPU is). Writes
models_bench_<part>_quick.json, and works in bench/results/models_bench_quick/; the photo crops
are kept in /tmp/ae-bench-data (written once, like the other benches' data).
"""

from __future__ import annotations

import argparse
import csv
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from ae.data.shards.writer import png_bytes, write_shards
from ae.log_lines import PROCESSED_TRAIN
from bench.common import one_thread_per_process, results_dir, write_record
from bench.real_images import real_photos

ROOT = Path(__file__).resolve().parent.parent
SIZE = 64
VAL_PHOTOS = ("coffee.png", "coins.png", "gravel.png", "rocket.jpg")
COMMON = ["--devices=1", "--num_workers=1", "--batch_size=32", "--learning_rate=1e-3",
          "--warmup_steps=50", "--checkpointing_period=0", "--save_best=false",
          "--sample_batch_size=8", "--log_every_n_train_batches=6"]  # fmt: skip
MODELS = {  # name -> flags; pairs share a latent size
    "conv, latent 256": ["--model=conv", "--hidden_dim=64", "--latent_dim=256"],
    "resnet f=8, latent 4x8x8": ["--model=resnet", "--downsample=8", "--base_channels=16",
                                 "--channel_mult=1,2,4,4", "--res_blocks=1"],
    "conv, latent 1024": ["--model=conv", "--hidden_dim=64", "--latent_dim=1024"],
    "resnet f=4, latent 4x16x16": ["--model=resnet", "--downsample=4", "--base_channels=32",
                                   "--channel_mult=1,2,4", "--res_blocks=1"],
}  # fmt: skip
# `compile`: the resnet f=8 layout at a size a shared 2-core CPU steps through in seconds.
COMPILE_MODEL = ["--model=resnet", "--downsample=8", "--base_channels=8", "--channel_mult=1,2,4,4",
                 "--res_blocks=1", "--image_size=16", "--batch_size=16"]  # fmt: skip
EXTRA: list[str] = []  # --accelerator of this bench run (main); --quick: --image_size
QUICK_SIZE = 16  # --quick: the crops' side in training and in the grid
QUICK_DATA = Path("/tmp/ae-bench-data")


ZOOMS = (1.0, 1.3, 1.7)
POSITIONS = ((0.5, 0.5), (0.0, 0.25), (1.0, 0.75), (0.25, 1.0), (0.75, 0.0), (0.1, 0.6))


def photo_crops(photo: Image.Image, size: int) -> list[np.ndarray]:
    """36 distinct size x size RGB uint8 crops of one photo: the shorter side resized to `size`
    x zoom (Lanczos), a crop at each of 6 positions, each also mirrored."""
    crops = []
    w, h = photo.size
    for zoom in ZOOMS:
        s = size / min(w, h) * zoom
        im = photo.resize((max(size, round(w * s)), max(size, round(h * s))), Image.LANCZOS)
        for px, py in POSITIONS:
            x0, y0 = round((im.width - size) * px), round((im.height - size) * py)
            crop = np.asarray(im.crop((x0, y0, x0 + size, y0 + size)))
            crops += [crop, np.ascontiguousarray(crop[:, ::-1])]
    return crops


def photo_shards(root: Path) -> tuple[str, str]:
    """Train and val shard specs of the 64x64 photo crops (written once, then reused)."""
    out = root / f"photos{SIZE}"
    if not (out / "DONE").exists():
        shutil.rmtree(out, ignore_errors=True)
        split: dict[str, list[dict[str, bytes]]] = {"train": [], "val": []}
        for path in real_photos(out / "photos"):  # sorted by name, `skimage_<name>`
            part = "val" if path.name.removeprefix("skimage_") in VAL_PHOTOS else "train"
            with Image.open(path) as im:
                photo = im.convert("RGB")
            for crop in photo_crops(photo, SIZE):
                key = f"{len(split['train']) + len(split['val']):06d}".encode()
                split[part].append({"__key__": key, "png": png_bytes(crop)})
        write_shards(out, "train", split["train"], per_shard=144)
        write_shards(out, "val", split["val"], per_shard=144)
        (out / "DONE").write_text("")
    return f"{out}/train-*.tar", f"{out}/val-*.tar"


def train(name: str, flags: list[str], data: tuple[str, str], out: Path, epochs: int) -> Path:
    shutil.rmtree(out, ignore_errors=True)
    cmd = [sys.executable, "-m", "ae.cli.launch", f"--output_dir={out}",
           f"--train_shards={data[0]}", f"--val_shards={data[1]}", f"--max_epochs={epochs}",
           *COMMON, *EXTRA, *flags]  # fmt: skip
    print(f"--- {name}: {' '.join(flags)}", flush=True)
    res = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if res.returncode != 0:
        raise RuntimeError(f"{name} failed:\n{res.stdout[-3000:]}{res.stderr[-3000:]}")
    return out


def final_metrics(out: Path) -> dict[str, Any]:
    (path,) = (out / "metrics").glob("*/metrics.csv")
    with open(path, newline="") as f:
        rows = [r for r in csv.DictReader(f) if r.get("val/psnr")]
    last = rows[-1]
    (log,) = (out / "logs").glob("train_*.log")
    model = re.search(r"Model: (.*)", log.read_text())
    params = re.search(r"([\d,]+) parameters", model[1] if model else "")
    grids = sorted((out / "samples").glob("*.png"))
    return {
        "steps": int(last["step"]) + 1,  # the CSV has the index of the last step
        "val_mse": float(last["val/mse"]),
        "val_psnr": float(last["val/psnr"]),
        "val_ssim": float(last["val/ssim"]),
        "params": int(params[1].replace(",", "")) if params else None,
        "model_line": model[1] if model else None,
        "grid": str(grids[-1]) if grids else None,
    }


def rates(out: Path) -> dict[int, float]:
    """Steps/s of each epoch, from rank 0's `Processed N training batches (epoch e, R
    batches/s)` lines (the last line of an epoch covers all of it)."""
    (log,) = (out / "logs").glob("debug_rank0_*.log")
    lines = [PROCESSED_TRAIN.parse(line) for line in log.read_text().splitlines()]
    return {int(m["epoch"]): float(m["rate"]) for m in lines if m}


def quality(
    data: tuple[str, str], epochs: int, work: Path, models: dict[str, list[str]]
) -> dict[str, Any]:
    results = {}
    for i, (name, flags) in enumerate(models.items()):
        out = train(name, flags, data, work / f"quality-{i}", epochs)
        results[name] = {"flags": flags, **final_metrics(out)}
        print(json.dumps(results[name]), flush=True)
    return results


def compile_speed(data: tuple[str, str], epochs: int, work: Path) -> dict[str, Any]:
    flags = COMPILE_MODEL
    result = {}
    for mode in ("eager", "compile"):
        extra = ["--compile=true"] if mode == "compile" else []
        out = train(f"resnet f=8 {mode}", [*flags, *extra, "--sample_every_epoch=false"], data,
                    work / f"compile-{mode}", epochs)  # fmt: skip
        per_epoch = rates(out)
        result[mode] = {"steps_per_s_by_epoch": per_epoch, "steps_per_s": per_epoch[epochs - 1]}
        print(mode, per_epoch, flush=True)
    result["speedup"] = result["compile"]["steps_per_s"] / result["eager"]["steps_per_s"]
    return result


def comparison_grid(
    val_spec: str, work: Path, models: dict[str, list[str]], image_size: int = 0
) -> Path:
    """One PNG: 8 validation crops (2 of each held-out photo) above each quality run's
    reconstructions (its final checkpoint), a row per model, labelled; `image_size`: the runs'
    `--image_size` (0: the crops' own)."""
    import torch
    from PIL import ImageDraw

    from ae.config import DataConfig
    from ae.data.decoding.decode import SampleDecoder
    from ae.data.shards.spec import expand_shards
    from ae.data.shards.tar_samples import iter_samples
    from ae.training.encoding import load_checkpoint, model_from_checkpoint
    from ae.training.plots import to_image
    from ae.training.position.checkpoint_read import spec_from_record

    samples = [s for url in expand_shards(val_spec) for s in iter_samples(url)]
    picks = [samples[i] for i in range(0, len(samples), len(samples) // 8)][:8]
    decoder = SampleDecoder.probe(picks[0], DataConfig(image_size=image_size))
    x = torch.from_numpy(np.stack([decoder.decode(s) for s in picks]))
    rows = [("input", x)]
    for i, name in enumerate(models):
        ckpt = load_checkpoint(work / f"quality-{i}" / "checkpoints" / "last.ckpt")
        spec = spec_from_record(ckpt["hyper_parameters"]["spec"])
        model, _ = model_from_checkpoint(ckpt, spec, name)
        with torch.no_grad():
            rows.append((name, model.decode(model.encode(x))))
    tile, gap, label_w = 2 * SIZE, 4, 190
    canvas = Image.new("RGB", (label_w + 8 * (tile + gap), len(rows) * (tile + gap)), "white")
    draw = ImageDraw.Draw(canvas)
    for r, (name, images) in enumerate(rows):
        y = r * (tile + gap)
        draw.text((4, y + tile // 2 - 6), name, fill=(40, 40, 40))
        for c, image in enumerate(images.numpy()):
            big = to_image(image).resize((tile, tile), Image.NEAREST)
            canvas.paste(big, (label_w + c * (tile + gap), y))
    path = work / "comparison.png"
    canvas.save(path)
    return path


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--part", choices=("quality", "compile", "grids", "both"), default="both")
    p.add_argument("--epochs", type=int, default=40, help="quality runs (18 steps an epoch)")
    p.add_argument("--compile_epochs", type=int, default=4)
    p.add_argument("--accelerator", choices=("auto", "cpu", "gpu"), default="auto")
    p.add_argument("--quick", action="store_true", help="1 epoch of 1 model, no compile part")
    args = p.parse_args()
    EXTRA.append(f"--accelerator={args.accelerator}")
    models = dict(list(MODELS.items())[:1]) if args.quick else MODELS
    epochs = 1 if args.quick else args.epochs
    work = results_dir() / ("models_bench_quick" if args.quick else "models_bench")
    data = photo_shards(QUICK_DATA if args.quick else results_dir())
    image_size = 0
    if args.quick:  # the first train shard: 144 crops, 4 steps an epoch instead of 18
        data = (data[0].replace("train-*.tar", "train-000000.tar"), data[1])
        image_size = QUICK_SIZE
        EXTRA.append(f"--image_size={image_size}")
        one_thread_per_process()
    record: dict[str, Any] = {"epochs": epochs, "data": data, "common": [*COMMON, *EXTRA]}
    if args.part in ("quality", "both"):
        record["quality"] = quality(data, epochs, work, models)
    if args.part in ("quality", "grids", "both"):
        record["comparison_grid"] = str(comparison_grid(data[1], work, models, image_size))
        print(record["comparison_grid"], flush=True)
    if args.part in ("compile", "both"):
        if args.quick:
            print("--quick: no compile part (compiling takes minutes on a CPU)", flush=True)
        else:
            record["compile"] = compile_speed(data, args.compile_epochs, work)
    print(write_record(f"models_bench_{args.part}", record, quick=args.quick))


if __name__ == "__main__":
    main()
