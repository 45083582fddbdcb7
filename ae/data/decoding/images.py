"""Images: encoded bytes -> float32 (C, H, W) arrays in [0, 1], for every size and mode.

Each image goes through these steps, all in Pillow (never a home-made resampling kernel):

1. open: Pillow tells the format from the bytes (the field's extension only routes it here);
2. with `--image_size=N`, a JPEG is `draft()`ed: the decoder itself scales by 1/2, 1/4 or 1/8,
   the most that keeps both sides >= N, so a 500x400 photo for 64x64 is decoded at 125x100
   (most JPEGs are decoded by TurboJPEG at that scale instead: the same pixels in half the CPU
   time, `ae.data.decoding.jpeg`);
3. its mode becomes L or RGB (`--channels`) before any resampling, by Pillow's `convert`, as
   WebDataset's `.decode("pil")` does: palette and CMYK are converted, alpha is dropped (not
   composited). 16-bit grayscale keeps its high byte (Pillow's `convert` would clip it to white);
4. with N: the square of side min(width, height) at the crop position (the center, or a random
   one in training) is resized to N x N by one `Image.resize(box=...)` (bilinear, antialiased):
   resizing the shorter side to N, then cropping N x N, without resampling the cropped-off part;
5. in training with `--random_flip`, a horizontal flip of half of the images.

EXIF orientation is not applied (WebDataset does not apply it either).
"""

from __future__ import annotations

import functools
import io
import warnings
from collections.abc import Mapping

import numpy as np
from PIL import Image

from ae.data.decoding.jpeg import drafted

GRAYSCALE_MODES = frozenset({"1", "L", "LA", "La", "I", "I;16", "I;16L", "I;16B", "I;16N", "F"})
_SIXTEEN_BIT = frozenset({"I", "I;16", "I;16L", "I;16B", "I;16N"})
CENTER = (0.5, 0.5)


@functools.cache
def image_extensions() -> frozenset[str]:
    """Every file extension Pillow can open (how WebDataset's own list was made)."""
    Image.init()
    return frozenset(ext[1:] for ext, fmt in Image.EXTENSION.items() if fmt in Image.OPEN)


def mode_for(channels: int, first_mode: str) -> str:
    """The mode every image is converted to: `channels` (1 or 3), or 0 = from the first image."""
    if channels == 0:
        channels = 1 if first_mode in GRAYSCALE_MODES else 3
    return "L" if channels == 1 else "RGB"


def to_mode(img: Image.Image, mode: str) -> Image.Image:
    """`img` in `mode` (L or RGB)."""
    if img.mode == mode:
        return img
    if img.mode in _SIXTEEN_BIT:
        high = (np.clip(np.asarray(img), 0, 65535) >> 8).astype(np.uint8)
        img = Image.fromarray(high)
        return img if mode == "L" else img.convert(mode)
    if img.mode == "P" and "transparency" in img.info:
        with warnings.catch_warnings():  # "should be converted to RGBA": the alpha is dropped
            warnings.simplefilter("ignore")
            return img.convert(mode)
    return img.convert(mode)


def square_box(width: float, height: float, at: tuple[float, float]) -> tuple[float, ...]:
    """The square of side min(width, height) whose offset is `at` (fractions 0..1 of the slack)."""
    side = min(width, height)
    x0, y0 = (width - side) * at[0], (height - side) * at[1]
    return (x0, y0, x0 + side, y0 + side)


def fit(
    img: Image.Image,
    size: int,
    at: tuple[float, float] = CENTER,
    extent: tuple[float, float] | None = None,
) -> Image.Image:
    """Shorter side resized to `size`, then the `size` x `size` crop at `at`. `extent`: the part
    of `img` that is picture (a drafted JPEG rounds its size up: 1023x681 at 1/8 is 128x86
    pixels, of which 127.875 x 85.125 are the picture); default: all of it."""
    width, height = extent or img.size
    box = square_box(width, height, at)
    return img.resize((size, size), Image.Resampling.BILINEAR, box=box, reducing_gap=3.0)


def to_array(img: Image.Image, flip: bool = False) -> np.ndarray:
    """An L or RGB image -> float32 (C, H, W) in [0, 1]."""
    return pixels_to_array(np.asarray(img), flip)


def pixels_to_array(pixels: np.ndarray, flip: bool = False) -> np.ndarray:
    """uint8 (H, W) or (H, W, 3) pixels -> float32 (C, H, W) in [0, 1]."""
    pixels = pixels[None] if pixels.ndim == 2 else pixels.transpose(2, 0, 1)
    if flip:
        pixels = pixels[:, :, ::-1]
    out = np.ascontiguousarray(pixels, dtype=np.float32)
    out *= 1.0 / 255.0
    return out


def open_image(data: bytes) -> Image.Image:
    """The image, opened lazily: format, mode and size are known, no pixel is decoded yet."""
    try:
        return Image.open(io.BytesIO(data))
    except Image.UnidentifiedImageError:
        # Pillow's own message names only its buffer (`<_io.BytesIO object at 0x7f...>`), which
        # tells a user nothing about the file: the same error, with what it means.
        raise Image.UnidentifiedImageError(
            f"not an image in any format Pillow reads ({len(data)} bytes: damaged, or another "
            "kind of file under an image extension)"
        ) from None


def decode_image(
    data: bytes, mode: str, size: int = 0, at: tuple[float, float] = CENTER, flip: bool = False
) -> np.ndarray:
    """Steps 1-5 of the module docstring; `size` 0 keeps the native size. Most JPEGs take
    steps 1-3 in TurboJPEG (`ae.data.decoding.jpeg`: the same pixels in half the time)."""
    fast = drafted(data, mode, size)
    if fast is None:
        return pillow_decode(data, mode, size, at, flip)
    pixels, extent = fast
    if not size or extent == (size, size):
        # Nothing to resize or crop (Pillow's resize would copy): no round trip through Pillow,
        # whose array <-> image copies cost a fifth of a 256 -> 64 image's time (profiled).
        return pixels_to_array(pixels, flip)
    return to_array(fit(Image.fromarray(pixels), size, at, extent), flip)


def pillow_decode(
    data: bytes, mode: str, size: int = 0, at: tuple[float, float] = CENTER, flip: bool = False
) -> np.ndarray:
    """`decode_image` by Pillow alone: every format, and the reference the TurboJPEG path is
    held to."""
    with open_image(data) as img:
        extent = None
        if size:
            # A YCbCr JPEG can be decoded straight to L; other modes are converted below.
            draft = img.draft("L" if mode == "L" else None, (size, size))
            if draft is not None:
                extent = draft[1][2:]
        img = to_mode(img, mode)
        if size:
            img = fit(img, size, at, extent)
        return to_array(img, flip)


def suggested_image_size(sizes: Mapping[str, int]) -> int:
    """The --image_size to suggest for images of these `WxH` sizes ({size: images}): 64, or the
    median shorter side when smaller (most images not upscaled; one 17-px photo among large ones
    does not set it). The run's message and `ae-shards inspect` say the same."""
    sides = sorted(
        side for size, n in sizes.items() for side in [min(int(v) for v in size.split("x"))] * n
    )
    return min(64, sides[len(sides) // 2]) if sides else 64
