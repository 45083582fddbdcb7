"""Sample decoding: raw tar member bytes -> float32 arrays the autoencoder trains on.

The input field of a sample is the first of `npy`, `png`, `jpg`, `jpeg` it holds. `.npy` arrays
become flat float32 vectors (MLP); images become float32 CHW in [0, 1] (conv net).
"""

from __future__ import annotations

import functools
import io
import math
from dataclasses import dataclass
from typing import Literal

import numpy as np
from PIL import Image

INPUT_FIELDS = ("npy", "png", "jpg", "jpeg")


class SampleError(ValueError):
    """A sample that cannot be used: no input field, undecodable bytes, or the wrong shape."""


@dataclass(frozen=True)
class InputSpec:
    kind: Literal["vector", "image"]
    shape: tuple[int, ...]  # (D,) or (C, H, W)


def input_field(sample: dict) -> str:
    for name in INPUT_FIELDS:
        if name in sample:
            return name
    fields = ", ".join(k for k in sample if not k.startswith("__"))
    raise SampleError(f"no input field ({'/'.join(INPUT_FIELDS)}) among: {fields or 'nothing'}")


_NPY_MAGIC = b"\x93NUMPY"


@functools.lru_cache(maxsize=256)
def _npy_layout(version: int, header: bytes) -> tuple[np.dtype, tuple[int, ...], bool, int]:
    # `header`: the bytes after magic and version (header length, then the dict literal).
    """dtype, shape and order of an `.npy` header. Samples of one dataset share a handful of
    headers, so numpy's (slow, `ast`-based) header parser runs once per distinct header."""
    stream = io.BytesIO(header)
    if version == 1:
        shape, fortran, dtype = np.lib.format.read_array_header_1_0(stream)
    else:
        shape, fortran, dtype = np.lib.format.read_array_header_2_0(stream)
    if dtype.hasobject:
        raise ValueError("object arrays (pickles) are not accepted")
    return dtype, shape, fortran, math.prod(shape)


def npy_array(data: bytes) -> np.ndarray:
    """`np.load` of `.npy` bytes without its per-call overhead: the header is parsed once per
    distinct header (cached) and the payload is a zero-copy `np.frombuffer` view."""
    if data[:6] != _NPY_MAGIC or len(data) < 10:
        raise ValueError("not an .npy array (bad magic)")
    version = data[6]
    size_len = 2 if version == 1 else 4
    start = 8 + size_len
    header_len = int.from_bytes(data[8:start], "little")
    end = start + header_len
    dtype, shape, fortran, count = _npy_layout(version, data[8:end])
    array = np.frombuffer(data, dtype=dtype, count=count, offset=end)
    if len(shape) == 1:
        return array
    return array.reshape(shape, order="F" if fortran else "C")


def decode_sample(sample: dict) -> np.ndarray:
    name = input_field(sample)
    data = sample[name]
    try:
        if name == "npy":
            return npy_array(data).reshape(-1).astype(np.float32, copy=False)
        with Image.open(io.BytesIO(data)) as img:
            arr = np.asarray(img)
    except Exception as e:  # any decoder failure is a property of this sample's bytes
        raise SampleError(f"cannot decode .{name}: {type(e).__name__}: {e}") from e
    if arr.ndim == 2:
        arr = arr[:, :, None]
    return np.ascontiguousarray(arr.transpose(2, 0, 1), dtype=np.float32) / 255.0


def spec_of(array: np.ndarray) -> InputSpec:
    if array.ndim == 1:
        return InputSpec("vector", tuple(array.shape))
    return InputSpec("image", tuple(array.shape))
