"""Real photographs for benchmarks: the ~20 photos that ship inside the scikit-image wheel.

scikit-image is not installed (it would pull scipy, networkx, imageio...): one pinned wheel is
fetched with `pip download --no-deps` (the package registry, through pip), its sha256 checked,
and the photos read straight out of the zip, each checked against a pinned sha256 too. Cached in
`$AE_REAL_IMAGES_CACHE`, else `~/.cache/ae-real-images`. Licences: scikit-image is BSD-3; the
photos are CC0, public domain or "no known copyright restrictions" (four carry no statement:
moon, page and the two Middlebury motorcycle frames).

`photo_crops` cuts many distinct size x size RGB images out of them (the shorter side resized to
the crop size at three zooms, six crop positions, mirrored or not: 36 crops per photo).
"""

from __future__ import annotations

import hashlib
import io
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import numpy as np
from PIL import Image

REQUIREMENT = "scikit-image==0.26.0"
WHEEL_SHA256 = "74aa5518ccea28121f57a95374581d3b979839adc25bb03f289b1bc9b99c58af"
PREFIX = "skimage/data/"
# Real photographs only (chessboard, phantom, the colour wheel, logos... are left out).
PHOTOS = {
    "astronaut.png": "88431cd9653ccd539741b555fb0a46b61558b301d4110412b5bc28b5e3ea6cb5",
    "brick.png": "7966caf324f6ba843118d98f7a07746d22f6a343430add0233eca5f6eaaa8fcf",
    "camera.png": "b0793d2adda0fa6ae899c03989482bff9a42d3d5690fc7e3648f2795d730c23a",
    "cell.png": "8d23a7fb81f7cc877cd09f330357fc7f595651306e84e17252f6e0a1b3f61515",
    "chelsea.png": "596aa1e7cb875eb79f437e310381d26b338a81c2da23439704a73c4651e8c4bb",
    "clock_motion.png": "f029226b28b642e80113d86622e9b215ee067a0966feaf5e60604a1e05733955",
    "coffee.png": "cc02f8ca188b167c775a7101b5d767d1e71792cf762c33d6fa15a4599b5a8de7",
    "coins.png": "f8d773fc9cfa6f4d8e5942dc34d0a0788fcaed2a4fefbbed0aef5398d7ef4cba",
    "grass.png": "b6b6022426b38936c43a4ac09635cd78af074e90f42ffa8227ac8b7452d39f89",
    "gravel.png": "c48615b451bf1e606fbd72c0aa9f8cc0f068ab7111ef7d93bb9b0f2586440c12",
    "hubble_deep_field.jpg": "3a19c5dd8a927a9334bb1229a6d63711b1c0c767fb27e2286e7c84a3e2c2f5f4",
    "ihc.png": "f8dd1aa387ddd1f49d8ad13b50921b237df8e9b262606d258770687b0ef93cef",
    "microaneurysms.png": "a1e1be59aa447f8ce082f7fa809997ab369a2b137cb6c4202abc647c7ccf6456",
    "moon.png": "78739619d11f7eb9c165bb5d2efd4772cee557812ec847532dbb1d92ef71f577",
    "motorcycle_left.png": "db18e9c4157617403c3537a6ba355dfeafe9a7eabb6b9b94cb33f6525dd49179",
    "motorcycle_right.png": "5fc913ae870e42a4b662314bc904d1786bcad8e2f0b9b67dba5a229406357797",
    "page.png": "341a6f0a61557662b02734a9b6e56ec33a915b2c41886b97509dedf2a43b47a3",
    "retina.jpg": "38a07f36f27f095e818aea7b96d34202c05176d30253c66733f2e00379e9e0e6",
    "rocket.jpg": "c2dd0de7c538df8d111e479619b129464d0269d0ae5fd18ca91d33a7fdfea95c",
    "text.png": "bd84aa3a6e3c9887850d45d606c96b2e59433fbef50338570b63c319e668e6d1",
}
# The wheel is the same file on every host: platform and ABI pinned (pip does not widen an
# explicit --platform to older manylinux tags, so all are listed).
_PIP_PLATFORM = [
    "--only-binary=:all:", "--platform", "manylinux_2_28_x86_64", "--platform",
    "manylinux_2_17_x86_64", "--platform", "manylinux2014_x86_64", "--python-version", "3.11",
    "--implementation", "cp", "--abi", "cp311",
]  # fmt: skip


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def cache_dir() -> Path:
    env = os.environ.get("AE_REAL_IMAGES_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "ae-real-images"


def _wheel() -> Path:
    wheels = cache_dir() / "wheels"
    wheels.mkdir(parents=True, exist_ok=True)
    for attempt in range(2):
        for p in sorted(wheels.glob("scikit_image-*.whl")):
            if _sha256(p.read_bytes()) == WHEEL_SHA256:
                return p
        if attempt == 0:
            req = wheels / "scikit_image.req.txt"
            req.write_text(f"{REQUIREMENT} --hash=sha256:{WHEEL_SHA256}\n")
            cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet",
                   "--disable-pip-version-check", *_PIP_PLATFORM, "--require-hashes",
                   "-r", str(req), "-d", str(wheels)]  # fmt: skip
            subprocess.run(cmd, check=True)
    raise RuntimeError(f"pip download of {REQUIREMENT} gave no wheel with the pinned hash")


def real_photos() -> dict[str, Image.Image]:
    """The 20 photographs, RGB, by file name (sorted)."""
    out = {}
    with zipfile.ZipFile(_wheel()) as zf:
        for name, digest in sorted(PHOTOS.items()):
            data = zf.read(PREFIX + name)
            if _sha256(data) != digest:
                raise RuntimeError(f"{name}: sha256 mismatch in the {REQUIREMENT} wheel")
            with Image.open(io.BytesIO(data)) as im:
                out[name] = im.convert("RGB")
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
