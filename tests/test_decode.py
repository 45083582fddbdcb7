import io

import numpy as np
import pytest

from ae.decode import SampleError, decode_sample, npy_array


@pytest.mark.parametrize("version", [(1, 0), (2, 0), (3, 0)])
@pytest.mark.parametrize(
    "array",
    [
        np.arange(5, dtype=np.float32),
        np.ones((3, 4)),
        np.asfortranarray(np.arange(12).reshape(3, 4)),
        np.float32(3.5),
        np.zeros((0, 3), dtype=np.int16),
    ],
)
def test_npy_array_equals_np_load(array: np.ndarray, version: tuple[int, int]) -> None:
    buf = io.BytesIO()
    np.lib.format.write_array(buf, np.asarray(array), version=version)
    got, want = npy_array(buf.getvalue()), np.load(io.BytesIO(buf.getvalue()))
    assert got.dtype == want.dtype and got.shape == want.shape and np.array_equal(got, want)


def test_bad_npy_is_a_sample_error() -> None:
    for data in (b"garbage bytes here", b"\x93NUMPY\x01\x00\xff\xff{'descr'"):
        with pytest.raises(SampleError, match=r"cannot decode \.npy"):
            decode_sample({"__key__": "k", "npy": data})
    buf = io.BytesIO()
    np.save(buf, np.array([{"a": 1}], dtype=object), allow_pickle=True)
    with pytest.raises(SampleError, match="object arrays"):
        decode_sample({"__key__": "k", "npy": buf.getvalue()})
