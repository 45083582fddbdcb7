"""The embedded demo dataset: 1,797 real 8x8 handwritten digits (UCI, via scikit-learn's copy),
written once as WebDataset PNG shards and cached, so `./train_ae.sh` trains on real data offline.

Source: E. Alpaydin, C. Kaynak, "Optical Recognition of Handwritten Digits", UCI Machine Learning
Repository (CC BY 4.0). `ae/data/shards/demo/digits.csv.gz`: 64 pixel values (0..16) and the label
per row.
"""

from __future__ import annotations

import gzip
import io
import os
from importlib import resources
from pathlib import Path

import numpy as np

from ae import atomic_files
from ae.data.shards.writer import Sample, png_bytes, write_shards

VERSION = "digits-v2"  # v2: shards carry index sidecars
NUM_VAL = 297  # 1,500 train / 297 val
TRAIN_PER_SHARD = 375


def cache_root() -> Path:
    return Path(os.environ.get("AE_CACHE_DIR", Path.home() / ".cache" / "ae"))


def with_demo_defaults(train_spec: str | None, val_spec: str | None) -> tuple[str, str | None]:
    """The shard specs, with the demo data standing in for an unset train spec (built on first
    use), and the demo val split for an unset val spec only then: a user's train shards without
    a val spec keep it None (validation held out of them, `ae.data.planning.holdout`). The launcher
    calls this once and hands the ranks the result."""
    if train_spec is not None:
        return train_spec, val_spec
    demo_train, demo_val = demo_shard_specs()
    return demo_train, val_spec or demo_val


def is_demo(spec: str | None) -> bool:
    """Whether `spec` is the demo data's (what the launcher hands the ranks for an unset
    --train_shards), so that the ranks can say so."""
    return spec is not None and spec.startswith(str(cache_root() / VERSION) + os.sep)


def demo_shard_specs() -> tuple[str, str]:
    """Build the demo shards if needed; return (train_spec, val_spec)."""
    root = cache_root() / VERSION
    if not (root / "DONE").exists():
        _build(root)
    n_train = -(-(1797 - NUM_VAL) // TRAIN_PER_SHARD)
    return (
        str(root / f"train-{{000000..{n_train - 1:06d}}}.tar"),
        str(root / "val-000000.tar"),
    )


def _load_digits() -> tuple[np.ndarray, np.ndarray]:
    raw = resources.files("ae.data.shards").joinpath("demo/digits.csv.gz").read_bytes()
    table = np.loadtxt(io.StringIO(gzip.decompress(raw).decode()), delimiter=",", dtype=np.int64)
    images = (table[:, :64].reshape(-1, 8, 8) * 255 // 16).astype(np.uint8)
    return images, table[:, 64]


def _build(root: Path) -> None:
    images, labels = _load_digits()
    samples: list[Sample] = [
        {"__key__": f"{i:06d}".encode(), "png": png_bytes(img), "cls": str(int(y)).encode()}
        for i, (img, y) in enumerate(zip(images, labels, strict=True))
    ]
    split = len(samples) - NUM_VAL

    def build(folder: Path) -> None:
        write_shards(folder, "train", samples[:split], TRAIN_PER_SHARD)
        write_shards(folder, "val", samples[split:], NUM_VAL)
        (folder / "DONE").write_text("ok\n")

    # Built beside the final folder, then renamed: concurrent launchers never see half a dataset
    # (when another one finished first, its identical copy is kept).
    root.parent.mkdir(parents=True, exist_ok=True)
    atomic_files.build_dir(root, build)
