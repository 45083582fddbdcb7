"""Write samples into WebDataset `.tar` shards (one tar member per sample field), each with its
index sidecar (`ae.shard_index`), so training counts samples without reading the shards."""

from __future__ import annotations

import io
import tarfile
from collections.abc import Iterable
from pathlib import Path

import numpy as np
from PIL import Image

from ae.shard_index import write_index

Sample = dict[str, bytes]  # {"__key__": b"000123", "png": b"...", "cls": b"3"}


def npy_bytes(array: np.ndarray) -> bytes:
    """The `.npy` file of `array`, as a sample field."""
    buf = io.BytesIO()
    np.save(buf, np.ascontiguousarray(array))
    return buf.getvalue()


def png_bytes(image: np.ndarray) -> bytes:
    """A PNG of a uint8 HxW (grayscale) or HxWx3 (RGB) array, as a sample field."""
    buf = io.BytesIO()
    Image.fromarray(image).save(buf, format="PNG")
    return buf.getvalue()


def write_shard(path: Path, samples: Iterable[Sample]) -> int:
    """Write one shard atomically (tmp file + rename) and its index; return the sample count."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    offsets: list[int] = []
    with tarfile.open(tmp, "w", format=tarfile.USTAR_FORMAT) as tar:
        for sample in samples:
            key = sample["__key__"].decode()
            offsets.append(tar.offset)  # where this sample's first header goes
            for ext, data in sample.items():
                if ext == "__key__":
                    continue
                info = tarfile.TarInfo(f"{key}.{ext}")
                info.size = len(data)
                info.mode = 0o444
                tar.addfile(info, io.BytesIO(data))
    tmp.replace(path)
    write_index(path, len(offsets), offsets)
    return len(offsets)


def write_shards(
    out_dir: Path, prefix: str, samples: Iterable[Sample], per_shard: int
) -> list[Path]:
    """Write `<prefix>-000000.tar`, ... with at most `per_shard` samples each (streamed: only one
    shard's samples are held at a time)."""
    paths: list[Path] = []
    chunk: list[Sample] = []

    def flush() -> None:
        path = out_dir / f"{prefix}-{len(paths):06d}.tar"
        write_shard(path, chunk)
        paths.append(path)
        chunk.clear()

    for sample in samples:
        chunk.append(sample)
        if len(chunk) == per_shard:
            flush()
    if chunk:
        flush()
    return paths
