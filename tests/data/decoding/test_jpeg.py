"""The TurboJPEG path (`ae.data.decoding.jpeg`) gives exactly Pillow's pixels, and leaves to
Pillow what it would not match."""

from __future__ import annotations

import io

import numpy as np
import pytest
from PIL import Image

from ae.data.decoding.images import decode_image, pillow_decode
from ae.data.decoding.jpeg import draft_scale, drafted


def _jpeg(width: int, height: int, mode: str = "RGB", seed: int = 0, **save: object) -> bytes:
    """A photo-like JPEG: a smooth colour field with fine noise."""
    rng = np.random.default_rng(seed)
    grid = Image.fromarray(rng.integers(0, 256, (8, 8, 3), dtype=np.uint8))
    base = np.asarray(grid.resize((width, height), Image.Resampling.BICUBIC), np.int16)
    noisy = np.clip(base + rng.integers(-20, 21, base.shape), 0, 255).astype(np.uint8)
    buf = io.BytesIO()
    Image.fromarray(noisy).convert(mode).save(buf, format="JPEG", **save)
    return buf.getvalue()


SIZES = [(256, 256), (256, 128), (500, 400), (257, 300), (1023, 681), (130, 70), (40, 30)]
SAVES = [
    {"quality": 90},  # 4:2:0
    {"quality": 75, "subsampling": 0},  # 4:4:4
    {"quality": 85, "subsampling": 1},  # 4:2:2
    {"quality": 90, "progressive": True},
]


@pytest.mark.parametrize(("width", "height"), SIZES)
@pytest.mark.parametrize("source", ["RGB", "L"])
def test_the_same_pixels_as_pillow_at_every_scale_crop_and_flip(
    width: int, height: int, source: str
) -> None:
    for i, save in enumerate(SAVES):
        data = _jpeg(width, height, source, seed=i, **save)
        for mode in ("RGB", "L"):
            for size in (64, 32, 0):
                for at, flip in (((0.5, 0.5), False), ((0.1, 0.9), True)):
                    ours = decode_image(data, mode, size, at, flip)
                    ref = pillow_decode(data, mode, size, at, flip)
                    assert ours.dtype == np.float32 and ours.shape == ref.shape
                    assert np.array_equal(ours, ref), (width, height, source, save, mode, size)


def test_it_takes_the_jpegs_and_leaves_the_rest_to_pillow() -> None:
    pixels, extent = drafted(_jpeg(500, 400), "RGB", 64)
    assert pixels.shape == (100, 125, 3) and extent == (125.0, 100.0)  # 1/4, as draft() picks
    pixels, _ = drafted(_jpeg(500, 400, "L"), "L", 0)
    assert pixels.shape == (400, 500)
    # Pillow's own RGB -> L luma at native size; CMYK; not a JPEG: Pillow decodes those
    assert drafted(_jpeg(64, 48), "L", 0) is None
    assert drafted(_jpeg(64, 48, "CMYK"), "RGB", 32) is None
    png = io.BytesIO()
    Image.new("RGB", (8, 8)).save(png, format="PNG")
    assert drafted(png.getvalue(), "RGB", 4) is None
    cmyk = _jpeg(64, 48, "CMYK")
    assert np.array_equal(decode_image(cmyk, "RGB", 32), pillow_decode(cmyk, "RGB", 32))


def test_a_broken_jpeg_raises_as_pillow_does() -> None:
    data = _jpeg(256, 256)
    for broken in (data[: len(data) // 2], data[:200] + bytes(len(data) - 200)):
        with pytest.raises(Exception):  # noqa: B017 -- Pillow raises OSError, TurboJPEG ValueError
            pillow_decode(broken, "RGB", 64)
        with pytest.raises(ValueError):
            decode_image(broken, "RGB", 64)


def test_draft_scale_is_pillows() -> None:
    for width, height, size in [(500, 400, 64), (1023, 681, 64), (64, 64, 64), (40, 30, 64)]:
        img = Image.open(io.BytesIO(_jpeg(width, height)))
        img.draft("RGB", (size, size))
        s = draft_scale(width, height, size)
        assert img.size == (-(-width // s), -(-height // s))
    assert draft_scale(500, 400, 0) == 1
