"""JPEGs decoded by libjpeg-turbo's TurboJPEG API (`simplejpeg`), at the scale Pillow's `draft()`
would pick, giving the very pixels Pillow gives, in about half the CPU time.

Measured on 256x256 quality-90 JPEGs taken to 64x64 (2 vCPU VM, one thread, CPU time per image):
Pillow `draft()` + load ~450-660 us, TurboJPEG at the same 1/4 scale ~320-350 us; full size
~990-1070 us against ~430-490 us. Both run libjpeg-turbo with the same DCT and upsampling (the
outputs are bit-identical); the difference is Pillow's way of feeding and unpacking its decoder.
Decode is 85-90% of an image's time in the input pipeline, so this is the image path's lever.

Only what is known to match Pillow takes this path (`tests/data/decoding/test_jpeg.py` checks
it): baseline or progressive JPEGs in YCbCr or grayscale, to RGB or L. CMYK/YCCK and Adobe RGB
JPEGs, and a colour JPEG to L at native size (Pillow converts RGB -> L by its own luma formula
there; TurboJPEG would take the Y channel), are left to Pillow: `drafted` returns None.

With `--image_decode=gpu` the colour JPEGs are not decoded here at all: `encoded_jpeg` reads the
header alone and the bytes go on to the rank's GPU (`ae.data.decoding.gpu_jpeg`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import simplejpeg

JPEG_MAGIC = b"\xff\xd8\xff"
_TO = {"RGB": "RGB", "L": "GRAY"}  # ae's modes -> TurboJPEG's output colorspaces
_FROM = frozenset({"YCbCr", "Gray"})  # source colorspaces whose decode matches Pillow's


def draft_scale(width: int, height: int, size: int) -> int:
    """Pillow's `draft()` scale for a `size` x `size` target: 8, 4, 2 or 1, the most that keeps
    both sides >= `size` (1 when `size` is 0: native size)."""
    fits = min(width // size, height // size) if size else 1
    return next((s for s in (8, 4, 2) if fits >= s), 1)


def drafted(data: bytes, mode: str, size: int) -> tuple[np.ndarray, tuple[float, float]] | None:
    """(uint8 pixels, H x W or H x W x 3, the picture's extent (width, height) in them) of a
    JPEG decoded at Pillow's draft scale for `size` (0: native size); None when the bytes are
    not a JPEG this path matches Pillow on (Pillow decodes those). Raises ValueError on bytes
    that start as a JPEG but do not decode (truncated, corrupt), as Pillow raises on them."""
    if mode not in _TO or not data.startswith(JPEG_MAGIC):
        return None
    height, width, colorspace, _ = simplejpeg.decode_jpeg_header(data)
    if colorspace not in _FROM or (mode == "L" and not size and colorspace != "Gray"):
        return None
    s = draft_scale(width, height, size)
    want = (-(-height // s), -(-width // s))  # Pillow's drafted size, rounded up
    pixels = simplejpeg.decode_jpeg(
        data, colorspace=_TO[mode], min_height=want[0], min_width=want[1]
    )
    if pixels.shape[:2] != want:  # TurboJPEG chose another of its scales (M/8): not Pillow's
        return None
    return (pixels[:, :, 0] if mode == "L" else pixels), (width / s, height / s)


_GPU_SOURCES = frozenset({"YCbCr"})  # source colorspaces nvJPEG decodes to the RGB ae trains on


@dataclass(frozen=True)
class EncodedJpeg:
    """One sample on its way to the GPU: its JPEG bytes and what to do with the decoded picture.
    `box`: (x0, y0, side) of the square crop in source pixels (side 0: no crop, native size)."""

    data: bytes
    shape: tuple[int, int, int]  # (3, H, W) after decode, crop and resize: the run's shape
    box: tuple[int, int, int]
    flip: bool
    source: tuple[str, str]  # (url, key): named in the log if the GPU cannot decode it


def encoded_jpeg(
    data: bytes,
    mode: str,
    size: int,
    at: tuple[float, float],
    flip: bool,
    source: tuple[str, str],
) -> EncodedJpeg | None:
    """The sample as bytes for the GPU, from its header alone; None when the GPU path does not
    take it (the worker decodes it). Raises ValueError on bytes whose JPEG header is damaged."""
    if mode != "RGB" or not data.startswith(JPEG_MAGIC):
        return None
    height, width, colorspace, _ = simplejpeg.decode_jpeg_header(data)
    if colorspace not in _GPU_SOURCES:
        return None
    if not size:
        return EncodedJpeg(data, (3, height, width), (0, 0, 0), flip, source)
    side = min(width, height)
    x0, y0 = round((width - side) * at[0]), round((height - side) * at[1])
    return EncodedJpeg(data, (3, size, size), (x0, y0, side), flip, source)
