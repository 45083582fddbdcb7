"""Tiny real shards for tests: samples with globally unique keys, written by ae's shard writer."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from ae.data.decoding.decode import SampleDecoder
from ae.data.shards.writer import Sample, npy_bytes, png_bytes, write_shard


def vector_samples(n: int, dim: int = 16, start: int = 0, seed: int = 0) -> list[Sample]:
    rng = np.random.default_rng(seed + start)
    return [
        {"__key__": f"{start + i:08d}".encode(), "npy": npy_bytes(rng.random(dim, np.float32))}
        for i in range(n)
    ]


def image_samples(n: int, size: int = 8, start: int = 0) -> list[Sample]:
    rng = np.random.default_rng(start)
    return [
        {
            "__key__": f"{start + i:08d}".encode(),
            "png": png_bytes(rng.integers(0, 256, (size, size), dtype=np.uint8)),
        }
        for i in range(n)
    ]


def write_test_shards(
    out: Path, sizes: list[int], kind: str = "npy", name: str = "train", dim: int = 16
) -> str:
    """`sizes` shards `<name>-000000.tar`... in `out` (vectors, or 8x8 PNGs for kind "png"), keys
    unique and consecutive across them; the brace spec of the set (the `make_shards` fixture)."""
    start = 0
    for i, n in enumerate(sizes):
        samples = vector_samples(n, dim, start) if kind == "npy" else image_samples(n, 8, start)
        write_shard(out / f"{name}-{i:06d}.tar", samples)
        start += n
    return str(out / f"{name}-{{000000..{len(sizes) - 1:06d}}}.tar")


def vector_decoder(dim: int = 16) -> SampleDecoder:
    """The decoder a run probes on `vector_samples`: the `npy` field, `dim` floats."""
    return SampleDecoder((("npy", None),), "vector", (dim,))


def image_decoder(size: int = 8) -> SampleDecoder:
    """The decoder a run probes on `image_samples`: grayscale `png`, native size."""
    return SampleDecoder((("png", None),), "image", (1, size, size), any_image=True, mode="L")


def id_samples(n: int, dim: int = 4, start: int = 0) -> list[Sample]:
    """Samples whose vector is their key's number in every element: a batch says which samples
    it holds (`tests/support/key_recorder.py`, the resume coverage tests)."""
    return [
        {"__key__": f"{start + i:08d}".encode(), "npy": npy_bytes(np.full(dim, start + i, "f4"))}
        for i in range(n)
    ]


def nan_sample(key: str, dim: int = 16, at: int = 3) -> Sample:
    """A sample whose array holds a real NaN (element `at`): a loss that turns non-finite from the
    data itself, as a corrupt record makes it (`ae.training.nonfinite`)."""
    array = np.full(dim, 0.5, np.float32)
    array[at] = np.nan
    return {"__key__": key.encode(), "npy": npy_bytes(array)}
