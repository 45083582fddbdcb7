"""Sample decoding: raw tar member bytes -> float32 arrays the autoencoder trains on.

The input field of a sample is the first of `npy`, `png`, `jpg`, `jpeg` it holds. `.npy` arrays
become flat float32 vectors (MLP); images become float32 CHW in [0, 1] (conv net).
"""

from __future__ import annotations

import io
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


def decode_sample(sample: dict) -> np.ndarray:
    name = input_field(sample)
    data = sample[name]
    try:
        if name == "npy":
            return np.load(io.BytesIO(data), allow_pickle=False).astype(np.float32).reshape(-1)
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
