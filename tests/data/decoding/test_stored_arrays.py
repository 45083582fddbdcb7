"""The run's Input field line says how the first array was stored when it is not a float32
vector: another tool's int8 or 2-D `.npy` was trained on flattened and unscaled without a word
(only `ae-shards inspect` said so)."""

from __future__ import annotations

import io

import numpy as np
import pytest

from ae.config import DataConfig
from ae.data.decoding.decode import SampleDecoder


def _npy(array: np.ndarray) -> bytes:
    out = io.BytesIO()
    np.save(out, array)
    return out.getvalue()


@pytest.mark.parametrize(
    ("array", "scale", "said"),
    [
        (np.zeros(16, np.float32), 1.0, "vectors of 16 float32"),
        (np.zeros(16), 1.0, "vectors of 16 float32 (stored as float64; converted)"),
        (np.zeros(4, np.int8), 1.0, "(stored as int8; integers not rescaled, --npy_scale=S"),
        (np.zeros((4, 8), np.float32), 1.0, "vectors of 32 float32 (stored as float32 4x8; flat"),
        (np.zeros((2, 3), np.uint8), 0.5, "vectors of 6 float32, times 0.5 (stored as uint8 2x3;"
         " flattened)"),
    ],
)  # fmt: skip
def test_input_line_says_how_the_first_array_was_stored(
    array: np.ndarray, scale: float, said: str
) -> None:
    decoder = SampleDecoder.probe({"__key__": "k", "npy": _npy(array)}, DataConfig(npy_scale=scale))
    text = decoder.describe()
    assert said in text
    if array.dtype == np.float32 and array.ndim == 1:
        assert text == said  # the common case says nothing more
    assert decoder.shape == (array.size,)


def test_a_pth_tensor_of_another_dtype_is_said_too() -> None:
    torch = pytest.importorskip("torch")
    out = io.BytesIO()
    torch.save(torch.zeros(3, 2, dtype=torch.float64), out)
    decoder = SampleDecoder.probe({"__key__": "k", "pth": out.getvalue()}, DataConfig())
    assert (
        decoder.describe() == "vectors of 6 float32 (stored as float64 3x2; flattened; converted)"
    )
