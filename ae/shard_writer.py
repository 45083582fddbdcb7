"""Write samples into WebDataset `.tar` shards (one tar member per sample field)."""

from __future__ import annotations

import io
import tarfile
from collections.abc import Iterable
from pathlib import Path

Sample = dict[str, bytes]  # {"__key__": b"000123", "png": b"...", "cls": b"3"}


def write_shard(path: Path, samples: Iterable[Sample]) -> int:
    """Write one shard atomically (tmp file + rename); return the number of samples written."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    n = 0
    with tarfile.open(tmp, "w", format=tarfile.USTAR_FORMAT) as tar:
        for sample in samples:
            key = sample["__key__"].decode()
            for ext, data in sample.items():
                if ext == "__key__":
                    continue
                info = tarfile.TarInfo(f"{key}.{ext}")
                info.size = len(data)
                info.mode = 0o444
                tar.addfile(info, io.BytesIO(data))
            n += 1
    tmp.replace(path)
    return n


def write_shards(out_dir: Path, prefix: str, samples: list[Sample], per_shard: int) -> list[Path]:
    """Split `samples` into `<prefix>-000000.tar`, ... with at most `per_shard` samples each."""
    paths = []
    for i, start in enumerate(range(0, len(samples), per_shard)):
        path = out_dir / f"{prefix}-{i:06d}.tar"
        write_shard(path, samples[start : start + per_shard])
        paths.append(path)
    return paths
