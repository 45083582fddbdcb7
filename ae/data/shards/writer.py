"""Write samples into WebDataset `.tar` shards (one tar member per sample field), each with its
index sidecar (`ae.data.shards.index`), so training counts samples without reading the shards.

`compress="gz"` writes gzip'd shards (`.tar.gz`, still WebDataset's format): every member's
512-byte header and padding compress to almost nothing, so small samples cost several times
fewer bytes (64-dim float32 vectors: 7.8x fewer). That is for shards read from object storage or
http, where bytes are time; local shards stay plain: a compressed shard is read from the top
(its sidecar holds the count, no offsets) and never takes the columnar path."""

from __future__ import annotations

import io
import tarfile
from collections.abc import Iterable
from pathlib import Path
from typing import Literal

import numpy as np
from PIL import Image

from ae.atomic_files import AtomicFile
from ae.data.shards.index import write_index
from ae.data.shards.keys import safe_key

Sample = dict[str, bytes]  # {"__key__": b"000123", "png": b"...", "cls": b"3"}
Compression = Literal["none", "gz", "bz2", "xz"]
# What `ae-shards write --compress` offers (bz2 and xz are read, and written by ae-encode under
# an input's name, but cost more CPU to read than gzip for what they save)
SUFFIXES: dict[Compression, str] = {"none": ".tar", "gz": ".tar.gz"}
GZIP_LEVEL = 6  # gzip's own default: level 9 takes twice as long here for 1% fewer bytes
_BY_NAME: dict[str, Compression] = {".tar.gz": "gz", ".tgz": "gz", ".tar.bz2": "bz2",
                                    ".tar.xz": "xz"}  # fmt: skip


def compression_of(name: str) -> Compression:
    """The compression a shard's file name says (`x.tar.gz`: gz), as `tar` reads it by name."""
    return next((c for suffix, c in _BY_NAME.items() if name.endswith(suffix)), "none")


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

    def __init__(self, path: Path, compress: Compression = "none") -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self.compressed = compress != "none"
        # Open across add() calls: committed by close(), dropped by discard().
        self._out = AtomicFile(path, durable=False)
        out = self._out.file
        kw = {"compresslevel": GZIP_LEVEL} if compress == "gz" else {}
        mode = "w" if compress == "none" else f"w:{compress}"
        self._tar = tarfile.open(  # noqa: SIM115
            str(path), mode, out, format=tarfile.USTAR_FORMAT, **kw
        )
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
            self._tar.close()  # the end-of-archive blocks (and gzip's trailer) may find the disk
            # full too; tarfile closes the gzip stream it opened, not the file beneath it
        except BaseException:
            self._out.discard()
            raise
        self._out.commit()
        # offsets count uncompressed bytes: no use for seeking in a gzip'd shard
        write_index(self.path, len(self.offsets), None if self.compressed else self.offsets)
        return len(self.offsets)

    def discard(self) -> None:
        """Drop a shard that cannot be finished (its temporary file goes, nothing else changes;
        the tar's end blocks are not written: they could fail again on a full disk)."""
        self._out.discard()


def write_shard(path: Path, samples: Iterable[Sample], compress: Compression = "none") -> int:
    """Write one shard atomically and its index; return the sample count."""
    writer = ShardWriter(path, compress)
    try:
        for sample in samples:
            writer.add(sample)
    except BaseException:
        writer.discard()
        raise
    return writer.close()


def write_shards(
    out_dir: Path,
    prefix: str,
    samples: Iterable[Sample],
    per_shard: int,
    compress: Compression = "none",
) -> list[Path]:
    """Write `<prefix>-000000.tar` (`.tar.gz` gzip'd), ... with at most `per_shard` samples
    each (streamed: only one shard's samples are held at a time)."""
    paths: list[Path] = []
    chunk: list[Sample] = []

    def flush() -> None:
        path = out_dir / f"{prefix}-{len(paths):06d}{SUFFIXES[compress]}"
        write_shard(path, chunk, compress)
        paths.append(path)
        chunk.clear()

    for sample in samples:
        chunk.append(sample)
        if len(chunk) == per_shard:
            flush()
    if chunk:
        flush()
    return paths
