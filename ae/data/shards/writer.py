"""Write samples into WebDataset `.tar` shards (one tar member per sample field), each with its
index sidecar (`ae.data.shards.index`), so training counts samples without reading the shards."""

from __future__ import annotations

import io
import tarfile
from collections.abc import Iterable
from pathlib import Path

import numpy as np
from PIL import Image

from ae.atomic_files import AtomicFile
from ae.data.shards.index import write_index
from ae.data.shards.keys import safe_key

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


class ShardWriter:
    """One shard written a sample at a time into a temporary file (`ae.atomic_files`, not
    fsynced); `close()` puts it in place and writes its index, so the shard appears whole or not
    at all."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        # Open across add() calls: committed by close(), dropped by discard().
        self._out = AtomicFile(path, durable=False)
        out = self._out.file
        self._tar = tarfile.open(fileobj=out, mode="w", format=tarfile.USTAR_FORMAT)  # noqa: SIM115
        self.offsets: list[int] = []
        self._keys: set[str] = set()

    def add(self, sample: Sample) -> None:
        # A dot in the key's file name would split it where WebDataset reads it back; made
        # unique again (in this shard) if the replacement meets another key.
        key = safe_key(sample["__key__"].decode())
        unique, n = key, 1
        while unique in self._keys:
            n += 1
            unique = f"{key}_{n}"
        self._keys.add(unique)
        key = unique
        self.offsets.append(self._tar.offset)  # where this sample's first header goes
        for ext, data in sample.items():
            if ext == "__key__":
                continue
            info = tarfile.TarInfo(f"{key}.{ext}")
            info.size = len(data)
            info.mode = 0o444
            self._tar.addfile(info, io.BytesIO(data))

    def close(self) -> int:
        """Finish the shard and its index; returns its sample count."""
        try:
            self._tar.close()  # the end-of-archive blocks: these may find the disk full too
        except BaseException:
            self._out.discard()
            raise
        self._out.commit()
        write_index(self.path, len(self.offsets), self.offsets)
        return len(self.offsets)

    def discard(self) -> None:
        """Drop a shard that cannot be finished (its temporary file goes, nothing else changes;
        the tar's end blocks are not written: they could fail again on a full disk)."""
        self._out.discard()


def write_shard(path: Path, samples: Iterable[Sample]) -> int:
    """Write one shard atomically and its index; return the sample count."""
    writer = ShardWriter(path)
    try:
        for sample in samples:
            writer.add(sample)
    except BaseException:
        writer.discard()
        raise
    return writer.close()


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
