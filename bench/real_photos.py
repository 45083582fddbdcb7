"""Real photographs for benchmarks, as RGB images, and distinct crops cut from them.

`real_photos` gives the 20 photographs of the scikit-image wheel (`bench.real_images` fetches
and checks them) as RGB images by their original names. `photo_crops` cuts many distinct
size x size RGB images out of them (the shorter side resized to the crop size at three zooms,
six crop positions, mirrored or not: 36 crops per photo).
"""

from __future__ import annotations

import numpy as np
from PIL import Image

from bench import real_images


def real_photos() -> dict[str, Image.Image]:
    """The 20 photographs, RGB, by file name (sorted)."""
    out = {}
    for path in real_images.real_photos(real_images.default_cache_dir() / "photos"):
        with Image.open(path) as im:
            out[path.name.removeprefix("skimage_")] = im.convert("RGB")
    return out


ZOOMS = (1.0, 1.3, 1.7)
POSITIONS = ((0.5, 0.5), (0.0, 0.25), (1.0, 0.75), (0.25, 1.0), (0.75, 0.0), (0.1, 0.6))


def photo_crops(photo: Image.Image, size: int) -> list[np.ndarray]:
    """36 distinct size x size RGB uint8 crops of one photo: the shorter side resized to `size`
    x zoom (Lanczos), a crop at each of 6 positions, each also mirrored."""
    crops = []
    w, h = photo.size
    for zoom in ZOOMS:
        s = size / min(w, h) * zoom
        im = photo.resize((max(size, round(w * s)), max(size, round(h * s))), Image.LANCZOS)
        for px, py in POSITIONS:
            x0, y0 = round((im.width - size) * px), round((im.height - size) * py)
            crop = np.asarray(im.crop((x0, y0, x0 + size, y0 + size)))
            crops += [crop, np.ascontiguousarray(crop[:, ::-1])]
    return crops
