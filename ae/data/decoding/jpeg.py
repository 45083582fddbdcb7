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
"""

from __future__ import annotations

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
