import gzip
import io
import tarfile
from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from ae.config import DataConfig
from ae.data.decoding.decode import Augment, SampleDecoder, SampleError, field_kind, npy_array
from ae.data.decoding.images import suggested_image_size
from ae.data.shards.errors import DataError
from ae.data.shards.tar_samples import iter_samples
from tests.support.shards import vector_decoder


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
            vector_decoder(3).decode({"__key__": "k", "npy": data})
    buf = io.BytesIO()
    np.save(buf, np.array([{"a": 1}], dtype=object), allow_pickle=True)
    with pytest.raises(SampleError, match="object arrays"):
        vector_decoder(3).decode({"__key__": "k", "npy": buf.getvalue()})


def _npy_bytes(array: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, array)
    return buf.getvalue()


def _image(size: tuple[int, int], mode: str = "RGB", fmt: str = "PNG", seed: int = 0) -> bytes:
    rng = np.random.default_rng(seed)
    pixels = rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).convert(mode).save(buf, format=fmt)
    return buf.getvalue()


def _probe(sample: dict, **flags) -> SampleDecoder:
    return SampleDecoder.probe(sample, DataConfig(**flags))


@pytest.mark.parametrize("dtype", ["float16", "float32", "float64", "int8", "uint8", "int64", "?"])
def test_npy_of_any_numeric_dtype_is_float32_as_stored(dtype: str) -> None:
    values = np.array([0, 1, 7, 100], dtype=dtype)
    sample = {"__key__": "k", "__url__": "u", "x.npy": _npy_bytes(values.reshape(2, 2))}
    got = _probe(sample).decode(sample)
    assert got.dtype == np.float32 and got.tolist() == values.astype(np.float32).tolist()
    scaled = _probe(sample, npy_scale=0.5).decode(sample)
    assert scaled.tolist() == (values.astype(np.float32) * 0.5).tolist()


def test_complex_and_structured_arrays_are_bad_samples() -> None:
    for array in (np.ones(3, np.complex64), np.zeros(2, dtype=[("a", "i4"), ("b", "f4")])):
        sample = {"__key__": "k", "npy": _npy_bytes(array)}
        with pytest.raises(SampleError, match="not a real number type"):
            vector_decoder(3).decode(sample)


def test_npz_named_or_only_array() -> None:
    buf = io.BytesIO()
    np.savez(buf, a=np.arange(3), b=np.ones(4, np.int16))
    sample = {"__key__": "k", "f.npz": buf.getvalue()}
    assert _probe(sample, input_key="f.npz/b").decode(sample).tolist() == [1, 1, 1, 1]
    with pytest.raises(SampleError, match=r"holds arrays \['a', 'b'\]: name one"):
        _probe(sample)
    with pytest.raises(SampleError, match="no array 'c'"):
        _probe(sample, input_key="f.npz/c")
    one = io.BytesIO()
    np.savez(one, only=np.arange(5))
    sample = {"__key__": "k", "f.npz": one.getvalue()}
    assert _probe(sample).decode(sample).tolist() == [0, 1, 2, 3, 4]


def test_pth_tensors_only_without_unpickling_objects() -> None:
    buf = io.BytesIO()
    torch.save(torch.arange(4, dtype=torch.bfloat16), buf)
    sample = {"__key__": "k", "t.pth": buf.getvalue()}
    assert _probe(sample).decode(sample).tolist() == [0, 1, 2, 3]
    sample = {"__key__": "k", "t.pt": buf.getvalue()}
    assert _probe(sample).decode(sample).tolist() == [0, 1, 2, 3]
    evil = io.BytesIO()
    torch.save({"obj": Fraction(1, 3)}, evil)  # an arbitrary class: weights_only refuses it
    with pytest.raises(SampleError, match=r"cannot decode \.t\.pth: UnpicklingError"):
        SampleDecoder((("t.pth", None),), "vector", (1,)).decode(
            {"__key__": "k", "t.pth": evil.getvalue()}
        )


def test_gzipped_field_is_decoded_by_its_inner_extension() -> None:
    sample = {"__key__": "k", "v.npy.gz": gzip.compress(_npy_bytes(np.arange(3.0)))}
    assert field_kind("v.npy.gz") == "vector"
    assert _probe(sample).decode(sample).tolist() == [0.0, 1.0, 2.0]


def test_field_kind_is_the_last_extension() -> None:
    assert [field_kind(f) for f in ("npy", "x.npy", "emb.f16.npy", "a.b.npz", "t.pt")] == [
        "vector"
    ] * 5
    assert [field_kind(f) for f in ("jpg", "image.jpeg", "rgb.png", "x.webp", "a.tiff")] == [
        "image"
    ] * 5
    assert [field_kind(f) for f in ("cls", "meta.json", "txt", "npy.txt", "x.npz.json")] == [
        None
    ] * 5


def test_default_input_is_the_first_decodable_field_of_the_first_sample() -> None:
    sample = {"__key__": "k", "cls": b"3", "meta.json": b"{}", "b.npy": _npy_bytes(np.ones(2))}
    sample["a.npy"] = _npy_bytes(np.zeros(5))
    decoder = _probe(sample)
    assert decoder.fields == (("b.npy", None),) and decoder.shape == (2,)
    assert _probe(sample, input_key="A.NPY").shape == (5,)  # fields are lowercase, as in wds
    with pytest.raises(SampleError, match="no decodable field among: cls, txt"):
        _probe({"__key__": "k", "cls": b"1", "txt": b"x"})
    with pytest.raises(DataError, match="input_key: cls has no decoder"):
        _probe(sample, input_key="cls")
    with pytest.raises(DataError, match="mixes array and image fields"):
        _probe(sample, input_key="b.npy;jpg")
    with pytest.raises(DataError, match="--image_size/--random_flip apply to images"):
        _probe(sample, image_size=32, random_flip=True)
    with pytest.raises(DataError, match=r"--image_size applies to images; .*\(leave it unset\)"):
        _probe(sample, image_size=64)  # was "--image_size apply to images ... leave them unset"


def test_missing_input_field_is_a_bad_sample_and_alternatives_work() -> None:
    first = {"__key__": "a", "x.npy": _npy_bytes(np.ones(3))}
    decoder = _probe(first)
    with pytest.raises(SampleError, match=r"no field x\.npy \(it has: y\.npy\)"):
        decoder.decode({"__key__": "b", "y.npy": _npy_bytes(np.ones(3))})
    both = _probe(first, input_key="y.npy;x.npy")
    assert both.decode({"__key__": "b", "y.npy": _npy_bytes(np.ones(3))}).shape == (3,)


def test_image_default_takes_any_image_extension_and_channels_from_the_first() -> None:
    gray = {"__key__": "a", "__url__": "u", "jpg": _image((40, 30), "L", "JPEG"), "path": b"a"}
    decoder = _probe(gray, image_size=16)
    assert decoder.mode == "L" and decoder.shape == (1, 16, 16)
    for fmt, ext in (("PNG", "png"), ("WEBP", "webp"), ("GIF", "gif")):
        other = {"__key__": "b", "__url__": "u", ext: _image((25, 60), "RGB", fmt)}
        assert decoder.decode(other).shape == (1, 16, 16)
    colour = {"__key__": "a", "__url__": "u", "image.png": _image((40, 30), "P")}
    assert _probe(colour).shape == (3, 30, 40)  # palette counts as colour; native size
    assert _probe(colour, channels=1).shape == (1, 30, 40)
    with pytest.raises(SampleError, match="images of several sizes need --image_size"):
        _probe(colour).decode({"__key__": "b", "image.png": _image((41, 30))})
    strict = _probe(gray, input_key="jpg", image_size=16)
    with pytest.raises(SampleError, match="no field jpg"):
        strict.decode({"__key__": "b", "png": _image((20, 20))})


def test_sixteen_bit_grayscale_keeps_its_high_byte() -> None:
    values = np.array([[0, 256, 65535, 32768]], dtype=np.uint16)
    buf = io.BytesIO()
    Image.fromarray(values).save(buf, format="PNG")  # opens as I;16
    sample = {"__key__": "k", "png": buf.getvalue()}
    decoder = _probe(sample)
    assert decoder.mode == "L"
    assert (decoder.decode(sample) * 255).round().tolist() == [[[0, 1, 255, 128]]]


def test_center_crop_and_per_sample_random_crops_and_flips() -> None:
    # A 60x20 image whose left third is black, middle grey, right third white.
    pixels = np.repeat(np.array([0, 128, 255], np.uint8), 20)[None, :].repeat(20, axis=0)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG")
    sample = {"__key__": "k", "__url__": "u", "png": buf.getvalue()}
    center = _probe(sample, image_size=10).decode(sample)
    # the middle square (the filter's support reaches one column into its neighbours)
    assert np.allclose(center[:, :, 1:-1], 128 / 255) and center[0, 0, 0] < center[0, 0, -1]
    decoder = _probe(sample, image_size=10, random_flip=True)
    crops = {}
    for epoch in range(40):
        a = decoder.decode(sample, Augment(seed=1, epoch=epoch))
        assert np.array_equal(a, decoder.decode(sample, Augment(seed=1, epoch=epoch)))
        crops[epoch] = a
    means = {round(float(a.mean()), 2) for a in crops.values()}
    assert len(means) > 10  # crop positions differ between epochs
    flipped = sum(a[0, 0, 0] > a[0, 0, -1] for a in crops.values())  # brighter left: flipped
    assert 5 < flipped < 35
    no_flip = _probe(sample, image_size=10)
    assert all(
        no_flip.decode(sample, Augment(1, e))[0, 0, 0]
        <= no_flip.decode(sample, Augment(1, e))[0, 0, -1]
        for e in range(20)
    )


def test_a_field_twice_in_a_sample_is_a_bad_sample(tmp_path: Path) -> None:
    path = tmp_path / "dup.tar"
    with tarfile.open(path, "w") as tar:
        for name in ("a.npy", "a.npy", "b.npy"):
            data = _npy_bytes(np.ones(2))
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    first, second = iter_samples(str(path))
    with pytest.raises(SampleError, match="field npy appears twice"):
        vector_decoder(2).decode(first)
    assert vector_decoder(2).decode(second).shape == (2,)


def test_the_image_size_suggested_for_images_of_several_sizes() -> None:
    """64, or the median shorter side when smaller: one tiny photo among large ones does not set
    it (the run's message and ae-shards inspect both say this one)."""
    assert suggested_image_size({"1411x1411": 30, "17x23": 1, "640x480": 9}) == 64
    assert suggested_image_size({"12x12": 3, "8x8": 1, "10x10": 1}) == 12
    assert suggested_image_size({"40x50": 2, "48x60": 1}) == 40
