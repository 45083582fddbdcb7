"""Sample decoding: a sample's input field -> the float32 array the autoencoder trains on.

A field is decoded by its last extension, as WebDataset does (`x.npy`, `embedding.npy` and `npy`
are all arrays; `image.jpg`, `rgb.png` and `jpg` all images; a `.gz` ending is gunzipped first):

- arrays: `npy` (any numeric dtype), `npz` (the named array: `--input_key=FIELD/NAME`, or its only
  one), `pth`/`pt` (a tensor, loaded with `torch.load(weights_only=True)`: no arbitrary unpickling)
  -> a flat float32 vector (MLP), values as stored, times `--npy_scale`;
- images: every extension Pillow opens -> float32 (C, H, W) in [0, 1] (conv net), through
  `ae.data.decoding.images` (mode conversion, resize and crop).

`SampleDecoder` is fixed once per run from the first sample (`SampleDecoder.probe`): which field
(`--input_key`, or the first decodable field of the first sample; a run refuses a sample with
several: `several_inputs`), array or image, the shape every sample must have, and for images the
mode and size. It is a small frozen dataclass, so it is pickled into the dataloader workers as it
is.
"""

from __future__ import annotations

import contextlib
import functools
import gzip
import hashlib
import io
import math
from dataclasses import dataclass, replace
from typing import Literal

import numpy as np

from ae.config import DataConfig
from ae.data.decoding.images import CENTER, decode_image, image_extensions, mode_for, open_image
from ae.data.decoding.jpeg import EncodedJpeg, encoded_jpeg
from ae.data.shards.errors import DataError
from ae.data.shards.keys import merged_files
from ae.data.shards.tar_samples import DUPLICATE

ARRAY_EXTENSIONS = ("npy", "npz", "pth", "pt")
Kind = Literal["vector", "image"]


class SampleError(ValueError):
    """A sample that cannot be used: no input field, undecodable bytes, or the wrong shape."""


@dataclass(frozen=True)
class InputSpec:
    kind: Kind
    shape: tuple[int, ...]  # (D,) or (C, H, W)


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


def npz_array(data: bytes, name: str | None) -> np.ndarray:
    with np.load(io.BytesIO(data), allow_pickle=False) as npz:
        names = list(npz.files)
        if name is None and len(names) != 1:
            raise ValueError(f"holds arrays {names}: name one with --input_key=FIELD/NAME")
        if name is not None and name not in names:
            raise ValueError(f"no array {name!r} (it holds {names})")
        return npz[name or names[0]]


def tensor_array(data: bytes) -> np.ndarray:
    import torch  # here: the launcher imports this module's package, and must stay torch-free

    value = torch.load(io.BytesIO(data), weights_only=True, map_location="cpu")
    if not isinstance(value, torch.Tensor):
        raise ValueError(f"holds a {type(value).__name__}, not a tensor")
    if value.is_complex():
        raise ValueError(f"dtype {value.dtype} is not real")
    if value.dtype == torch.bfloat16:  # numpy has no bfloat16; any other dtype kept as stored
        value = value.to(torch.float32)
    return value.detach().cpu().numpy()


def decoding_extension(field: str) -> tuple[str, bool]:
    """(decoding extension, gzipped?): `x.npy` -> (`npy`, False), `x.npy.gz` -> (`npy`, True)."""
    ext = field.rpartition(".")[2]
    if ext == "gz" and "." in field:
        return field[:-3].rpartition(".")[2], True
    return ext, False


def field_kind(field: str) -> Kind | None:
    """`vector` for an array field, `image` for an image field, None for one with no decoder."""
    ext, _ = decoding_extension(field.partition("/")[0])
    if ext in ARRAY_EXTENSIONS:
        return "vector"
    if ext in image_extensions():
        return "image"
    return None


def _stored_array(field: str, name: str | None, data: bytes) -> np.ndarray:
    """The array as stored (its own dtype and shape)."""
    ext, gzipped = decoding_extension(field)
    if gzipped:
        data = gzip.decompress(data)
    if ext == "npy":
        return npy_array(data)
    if ext == "npz":
        return npz_array(data, name)
    return tensor_array(data)


def _array(field: str, name: str | None, data: bytes) -> np.ndarray:
    return _flat_float32(_stored_array(field, name, data))


def _stored_note(array: np.ndarray, scaled: bool) -> str:
    """For the Input field line, a first array not stored as a float32 vector: a 2-D array is
    flattened, an int8 one trained on as -128..127 (inspect said so; the run did not)."""
    shape = f" {'x'.join(map(str, array.shape))}" if array.ndim != 1 else ""
    what = [
        "flattened" if shape else "",
        "integers not rescaled, --npy_scale=S multiplies them"
        if array.dtype.kind in "biu" and not scaled
        else "",
        "converted" if array.dtype.kind == "f" and array.dtype != np.float32 else "",
    ]
    if not (shape or array.dtype != np.float32):
        return ""
    return f"stored as {array.dtype}{shape}" + "".join(f"; {w}" for w in what if w)


_FLOAT32 = np.dtype(np.float32)


def _flat_float32(array: np.ndarray) -> np.ndarray:
    if array.dtype is _FLOAT32 and array.ndim == 1:  # as stored: most vector datasets, per sample
        return array
    if array.dtype.kind not in "biuf":
        raise ValueError(f"dtype {array.dtype} is not a real number type")
    return array.reshape(-1).astype(np.float32, copy=False)


@dataclass(frozen=True)
class Augment:
    """Training randomness of image preprocessing: the crop position and the flip of a sample
    are a hash of (seed, epoch, shard, key), so they do not depend on which samples were read
    before it: a resumed epoch crops every sample as the interrupted one would have."""

    seed: int
    epoch: int

    def draws(self, sample: dict) -> tuple[tuple[float, float], bool]:
        text = f"{self.seed}/{self.epoch}/{sample['__url__']}/{sample['__key__']}"
        bits = int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little")
        at = ((bits & 0xFFFFFF) / 0x1000000, ((bits >> 24) & 0xFFFFFF) / 0x1000000)
        return at, bool(bits >> 63)


@dataclass(frozen=True)
class SampleDecoder:
    """How every sample of a run is decoded; `probe` builds it from the first sample."""

    fields: tuple[tuple[str, str | None], ...]  # (field, npz array name): the first one present
    kind: Kind
    shape: tuple[int, ...]
    any_image: bool = False  # also take an image field of the first field's stem, any extension
    mode: str = "RGB"  # images: L or RGB
    image_size: int = 0
    random_flip: bool = False
    npy_scale: float = 1.0
    # `--image_decode=gpu`: the JPEGs the GPU decodes leave `decode` as bytes (`EncodedJpeg`,
    # `ae.data.decoding.gpu_jpeg`). Set for the train and val streams only, never for a caller
    # that needs the pixels here (the probe, the model check, reconstruction grids).
    gpu_jpeg: bool = False
    stored: str = ""  # arrays: how the first one was stored, when not as a float32 vector

    @property
    def spec(self) -> InputSpec:
        return InputSpec(self.kind, self.shape)

    @property
    def field_names(self) -> str:
        names = ";".join(f if n is None else f"{f}/{n}" for f, n in self.fields)
        return f"{names} or another image extension" if self.any_image else names

    def accepts(self, field: str) -> bool:
        """Whether `field` is (one of) the input field(s)."""
        if any(field == f for f, _ in self.fields):
            return True
        stem = self.fields[0][0].rpartition(".")[0]
        return self.any_image and field_kind(field) == "image" and field.rpartition(".")[0] == stem

    def _input(self, sample: dict) -> tuple[str, str | None, bytes]:
        for field, name in self.fields:
            data = sample.get(field)
            if data is not None:
                return field, name, data
        if self.any_image:
            for field, data in sample.items():
                if self.accepts(field):
                    return field, None, data
        fields = ", ".join(k for k in sample if not k.startswith("__")) or "nothing"
        raise SampleError(f"no field {self.field_names} (it has: {fields})")

    def header(self, sample: dict) -> tuple[str, str] | None:
        """(`WxH`, mode) of the sample's input image, from its header (nothing decoded); None
        when it has none or it does not open."""
        try:
            field, _, data = self._input(sample)
            with open_image(ungzipped(field, data)) as img:
                return f"{img.width}x{img.height}", img.mode
        except Exception:  # a bad sample: training reports it
            return None

    def decode(self, sample: dict, augment: Augment | None = None) -> np.ndarray | EncodedJpeg:
        """The sample's input array (with `gpu_jpeg`, a JPEG the GPU decodes: its bytes);
        SampleError when it has none, it does not decode, or its shape differs from the run's."""
        if DUPLICATE in sample:
            raise SampleError(sample[DUPLICATE])
        field, name = self.fields[0]
        data = sample.get(field)
        if data is None:
            field, name, data = self._input(sample)
        try:
            if self.kind == "vector":
                # the common case first: its two calls are most of a small sample's decode
                if field == "npy" or field.endswith(".npy"):
                    array = _flat_float32(npy_array(data))
                else:
                    array = _array(field, name, data)
                if self.npy_scale != 1.0:
                    array = array * np.float32(self.npy_scale)
            else:
                at, flip = CENTER, False
                if augment is not None:
                    at, flip = augment.draws(sample)
                    flip = flip and self.random_flip
                data = ungzipped(field, data)
                array = None
                if self.gpu_jpeg:
                    source = (sample.get("__url__", "?"), sample["__key__"])
                    array = encoded_jpeg(data, self.mode, self.image_size, at, flip, source)
                if array is None:
                    array = decode_image(data, self.mode, self.image_size, at, flip)
        except Exception as e:  # any decoder failure is a property of this sample's bytes
            raise SampleError(f"cannot decode .{field}: {type(e).__name__}: {e}") from e
        if array.shape != self.shape and self.shape:  # () while probing: no shape yet
            hint = "; images of several sizes need --image_size" if self.kind == "image" else ""
            raise SampleError(f"shape {array.shape}, expected {self.shape}{hint}")
        return array

    @classmethod
    def probe(cls, sample: dict, cfg: DataConfig) -> SampleDecoder:
        """The decoder for a run whose first sample is `sample`. DataError for flags that cannot
        work on this data; SampleError when this sample does not decode (try the next one)."""
        fields, any_image = _input_fields(sample, cfg.input_key)
        kinds = {field_kind(f) for f, _ in fields}
        if len(kinds) > 1:
            raise DataError(f"input_key: {cfg.input_key} mixes array and image fields")
        kind = kinds.pop()
        assert kind is not None
        image_flags = [
            flag
            for flag, on in (
                ("--image_size", cfg.image_size),
                ("--channels", cfg.channels),
                ("--random_flip", cfg.random_flip),
                ("--image_decode=gpu", cfg.image_decode == "gpu"),
            )
            if on
        ]
        if kind == "vector" and image_flags:
            one = len(image_flags) == 1
            raise DataError(
                f"{'/'.join(image_flags)} appl{'ies' if one else 'y'} to images; the input "
                f"field {fields[0][0]} is an array (leave {'it' if one else 'them'} unset)"
            )
        # Built twice: the first (no shape yet: unchecked) finds the field and decodes it.
        decoder = cls(fields, kind, (), any_image, "RGB", cfg.image_size, cfg.random_flip,
                      cfg.npy_scale)  # fmt: skip
        field, name, data = decoder._input(sample)
        if kind == "image":
            try:
                first_mode = open_image(ungzipped(field, data)).mode
            except Exception as e:
                raise SampleError(f"cannot decode .{field}: {type(e).__name__}: {e}") from e
            decoder = replace(decoder, mode=mode_for(cfg.channels, first_mode))
        else:
            with contextlib.suppress(Exception):  # not an array: decode() below says why
                stored = _stored_array(field, name, data)
                decoder = replace(decoder, stored=_stored_note(stored, cfg.npy_scale != 1.0))
        return replace(decoder, shape=tuple(decoder.decode(sample).shape))

    def describe(self) -> str:
        """What the train log says about the input."""
        if self.kind == "vector":
            scale = f", times {self.npy_scale:g}" if self.npy_scale != 1.0 else ""
            stored = f" ({self.stored})" if self.stored else ""
            return f"vectors of {self.shape[0]} float32{scale}{stored}"
        c, h, w = self.shape
        size = (
            f"resized and cropped to {h}x{w} (random crop in training, center otherwise"
            + (", random flips" if self.random_flip else "")
            + ")"
            if self.image_size
            else f"native size {h}x{w}, which every image must have"
        )
        return f"images, {c} channel{'s' if c > 1 else ''} ({self.mode}), {size}"


def several_inputs(sample: dict) -> str | None:
    """Without --input_key: the problem of a sample with more than one decodable field (which
    one is meant cannot be told from the data: tar order put a stray array of zeros before the
    photos once, and a run trained on the zeros); None with one or none."""
    decodable = [f for f in sample if not f.startswith("__") and field_kind(f) is not None]
    if len(decodable) < 2:
        return None
    key = sample.get("__key__", "?")
    fix = merged_files(key, decodable) or (
        f"name the one to train on with --input_key, e.g. --input_key={decodable[0]}"
    )
    # the first few named: a key with dots can make one sample of thousands of fields
    shown = ", ".join(decodable[:8]) + (
        f", ... ({len(decodable) - 8} more)" if len(decodable) > 8 else ""
    )
    return (
        f"input_key: the samples have {len(decodable)} decodable fields "
        f"({shown}, in sample {key}); {fix}"
    )


def ungzipped(field: str, data: bytes) -> bytes:
    return gzip.decompress(data) if field.endswith(".gz") else data


def _input_fields(
    sample: dict, input_key: str | None
) -> tuple[tuple[tuple[str, str | None], ...], bool]:
    """The input field alternatives, and whether any image extension of the first one's stem
    stands in for it (the default for images: a folder of .jpg and .png written by ae-shards)."""
    if input_key:
        fields = []
        for part in input_key.split(";"):
            field, _, name = part.strip().partition("/")
            field = field.lower()  # WebDataset lowercases field names
            if not field:
                continue
            if field_kind(field) is None:
                raise DataError(
                    f"input_key: {field} has no decoder (by its last extension: npy, npz, pth, "
                    "pt, or an image extension such as jpg, png, webp)"
                )
            fields.append((field, name or None))
        if not fields:
            raise DataError(f"input_key: {input_key!r} names no field")
        return tuple(fields), False
    for field in sample:
        if not field.startswith("__") and (kind := field_kind(field)) is not None:
            return ((field, None),), kind == "image"
    fields = ", ".join(k for k in sample if not k.startswith("__")) or "nothing"
    raise SampleError(
        f"no decodable field among: {fields} (by last extension: npy, npz, pth, pt, or an "
        "image extension such as jpg, png, webp); labels and captions (cls, txt, json) are not "
        "model inputs, and --input_key cannot make them one"
    )
