"""End-to-end on data nobody here wrote: real runs (torchrun, 1 rank on CPU: reading the data is
the point here, a second rank only costs a process; the split across ranks is
tests/e2e/test_split.py's), 1 epoch each, with a batch of 2 ranks' samples.

- vector shards written by WebDataset's own `TarWriter` (field `x.npy` among other fields, no
  index sidecars), one of them and the validation shard gzip-compressed (`.tar.gz`);
- real photographs of many sizes and modes (scikit-image's, plus RGBA/LA/P/CMYK/16-bit/WebP/GIF
  variants) made into shards by `ae-shards write photos/ data/`, trained with --image_size=32:
  the README's two commands.
Each run exits 0 and logs no bad sample.
"""

from __future__ import annotations

import csv
import re
from pathlib import Path

import numpy as np
import pytest
import webdataset as wds
from PIL import Image

from ae.cli.shards import main as ae_shards

pytestmark = pytest.mark.slow

TINY = ["--devices=1", "--max_epochs=1", "--hidden_dim=8", "--latent_dim=4",
        "--checkpointing_period=0", "--num_workers=2", "--log_every_n_train_batches=2"]  # fmt: skip


def _no_bad_data(text: str) -> None:
    assert "Bad sample" not in text and "Bad shard" not in text
    assert not re.search(r"\| ERROR ", text), [
        line for line in text.splitlines() if "ERROR" in line
    ]


def _tarwriter_vectors(out: Path, name: str, start: int, n: int) -> None:
    rng = np.random.default_rng(start)
    with wds.TarWriter(str(out / name)) as w:  # `.tar.gz` names are gzip-compressed
        for i in range(start, start + n):
            w.write({
                "__key__": f"{i:06d}",
                "cls": i % 10,
                "meta.json": {"i": i},
                "x.npy": rng.random(12, dtype=np.float32),
            })  # fmt: skip


def test_webdataset_tarwriter_vectors_and_a_gzip_shard(launch, tmp_path: Path) -> None:
    data = tmp_path / "wds"
    data.mkdir()
    for k, name in enumerate(["a-000.tar", "a-001.tar", "a-002.tar", "a-003.tar.gz"]):
        _tarwriter_vectors(data, name, 100 * k, 30 + 5 * k)
    _tarwriter_vectors(data, "val.tar.gz", 1000, 24)
    res = launch(
        [f"--train_shards={data}/a-*", f"--val_shards={data}/val.tar.gz", "--batch_size=16",
         *TINY],
    )  # fmt: skip
    assert res.returncode == 0, res.output
    main = res.text("train_*.log")
    # cls and meta.json come first in the tar (TarWriter sorts fields): not decodable, passed by
    assert "Input field x.npy (the first decodable field of the first sample): shape 12" in main
    # 150 samples // (1 rank x 16) = 9 batches per rank; no shard has a sidecar: all scanned
    assert re.search(r"Shard plan train: 4 shards, 150 samples -> 9 batches x 16 per rank", main)
    counts = "Shard counts train_shards: 4 shards, 150 samples (0 from index, 4 scanned)"
    assert counts in res.text("debug_rank0_*.log")
    text = res.text("debug_rank0_*.log")  # the one rank's
    _no_bad_data(text)
    assert re.findall(r"Processed (\d+) training batches \(epoch 0", text)[-1] == "9"
    assert "Data errors train_shards: 0 bad samples, 0 bad shard reads" in text


def test_folder_of_real_photos_in_two_commands(launch, tmp_path: Path, real_photos) -> None:
    photos = tmp_path / "photos"
    photos.mkdir()
    for p in real_photos:
        (photos / p.name).write_bytes(p.read_bytes())
    assert ae_shards(["write", str(photos), str(tmp_path / "data"), "--per_shard", "10"]) == 0
    # No --val_shards (the README's example): validation is held out of the photos.
    res = launch(
        [f"--train_shards={tmp_path / 'data'}", "--image_size=32", "--batch_size=8",
         "--sample_period=2", "--sample_batch_size=4", "--random_flip", *TINY],
    )  # fmt: skip
    assert res.returncode == 0, res.output
    main = res.text("train_*.log")
    assert "Input field png or another image extension" in main
    assert "shape 3x32x32, images, 3 channels (RGB), resized and cropped to 32x32" in main
    # 1% of 35 photos is less than one batch per rank (1 x 8): 8 held out, in stretches of each
    # shard, said on the console; the val loss comes from them, not from the demo digits.
    held_out = "Validation: 8 of the 35 samples of train_shards held out by sample"
    assert held_out in res.output and held_out in main
    assert re.search(r"Shard plan val: 4 shards, 8 samples -> 1 batches x 8 per rank", main)
    assert "digits" not in main
    (metrics,) = (tmp_path / "run" / "metrics").glob("*/metrics.csv")
    rows = list(csv.DictReader(metrics.open()))
    assert [float(r["val/loss"]) for r in rows if r["val/loss"]]  # validated, on those 8
    # the other 27 photos // (1 rank x 8) = 3 batches per rank
    assert re.search(r"Shard plan train: 4 shards, 27 samples -> 3 batches x 8 per rank", main)
    text = res.text("debug_rank0_*.log")  # the one rank's
    _no_bad_data(text)
    assert re.findall(r"Processed (\d+) training batches \(epoch 0", text)[-1] == "3"
    grids = sorted((tmp_path / "run" / "samples").glob("step_*.png"))
    assert [g.name for g in grids] == ["step_00000002.png", "step_00000003.png"]
    with Image.open(grids[-1]) as grid:  # 4 inputs over 4 reconstructions, 32 px scaled x2
        assert grid.size == (34 + 4 * (64 + 4) + 4, 2 * 64 + 3 * 4 + 4)
        pixels = np.asarray(grid.convert("RGB"))
    inputs = pixels[4:68, 38:]
    assert inputs.std() > 20  # photographs, not a blank or constant grid
