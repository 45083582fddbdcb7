"""The data of `bench.peers`: generated vectors and JPEGs, written in each library's format (the
writing timed), and a rate-limited http server on localhost. No ae code here: ae's side of the
bench (and every import of ae) is in `bench.peers`."""

from __future__ import annotations

import contextlib
import gzip
import http.server
import importlib.metadata
import io
import shutil
import sys
import threading
import time
from collections.abc import Callable, Iterable
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

PEERS = ("webdataset", "litdata", "mosaicml-streaming")
VEC_DIM, VEC_BATCH = 64, 4096
JPG_SIDE, JPG_SIZE, JPG_BATCH = 256, 64, 256
SHUFFLE_BUFFER = 1000  # ae's default --shuffle_buffer; webdataset's .shuffle() gets the same


def peer_versions() -> dict[str, str]:
    """The installed peers' versions (none installed: the bench skips; some missing, e.g. on a
    GPU lease that cannot install MosaicML's cloud SDKs: their rows are left out and named)."""
    versions = {}
    for name in PEERS:
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            versions[name] = importlib.metadata.version(name)
    return versions


def extra_installed(versions: dict[str, str]) -> bool:
    """Whether the peers extra is there: a peer beyond webdataset (which ae itself needs)."""
    return bool({"litdata", "mosaicml-streaming"} & set(versions))


def import_streaming() -> Any:
    """MosaicML's `streaming`. Its package imports `streaming.vision`, which imports torchvision
    (unused here); PyPI's torchvision is built against CUDA torch and cannot load beside a CPU
    torch ('operator torchvision::nms does not exist'). Then the two names it takes from it are
    stood in for, so that the part of the package this bench uses (MDSWriter, StreamingDataset)
    imports."""
    try:
        import torchvision  # noqa: F401
    except Exception:
        import types

        for name in [m for m in sys.modules if m.split(".")[0] == "torchvision"]:
            del sys.modules[name]
        stub = {
            "torchvision": {},
            "torchvision.datasets": {"VisionDataset": type("VisionDataset", (), {})},
            "torchvision.transforms": {},
            "torchvision.transforms.functional": {"to_tensor": None},
        }
        for name, attrs in stub.items():
            module = types.ModuleType(name)
            module.__dict__.update(attrs)
            sys.modules[name] = module
    import streaming

    return streaming


def timed(fn: Callable[[], Any]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def make_vectors(n: int) -> np.ndarray:
    return np.random.default_rng(0).random((n, VEC_DIM), dtype=np.float32)


def make_jpegs(n: int) -> list[bytes]:
    """`n` distinct 256x256 pictures: smooth colour fields (an 8x8 random grid, bicubic) with
    fine noise, JPEG quality 90 -- compressible like photos, not like white noise."""
    rng = np.random.default_rng(0)
    out = []
    for _ in range(n):
        grid = Image.fromarray(rng.integers(0, 256, (8, 8, 3), dtype=np.uint8))
        base = np.asarray(grid.resize((JPG_SIDE, JPG_SIDE), Image.Resampling.BICUBIC), np.int16)
        noise = rng.integers(-12, 13, base.shape, dtype=np.int16)
        img = Image.fromarray(np.clip(base + noise, 0, 255).astype(np.uint8))
        buf = io.BytesIO()
        img.save(buf, format="JPEG", quality=90)
        out.append(buf.getvalue())
    return out


def _samples(kind: str, data: Any, lo: int, hi: int) -> Iterable[dict[str, Any]]:
    field = "npy" if kind == "vec" else "jpg"
    for i in range(lo, hi):
        yield {"__key__": f"{i:09d}", field: data[i]}


def write_tars(kind: str, data: Any, out: Path, shards: int) -> tuple[list[str], float]:
    """WebDataset TarWriter shards: (urls, seconds)."""
    import webdataset as wds

    out.mkdir(parents=True, exist_ok=True)
    per = len(data) // shards
    urls = [str(out / f"shard-{i:06d}.tar") for i in range(shards)]

    def tars() -> None:
        for i, url in enumerate(urls):
            with wds.TarWriter(url) as sink:
                for sample in _samples(kind, data, i * per, (i + 1) * per):
                    sink.write(sample)

    return urls, timed(tars)


def gzip_tars(urls: list[str]) -> list[str]:
    """The same tars gzip'd (level 6, as `gzip`): `.tar.gz` beside each."""
    out = []
    for url in urls:
        gz = url + ".gz"
        with open(url, "rb") as src, gzip.open(gz, "wb", compresslevel=6) as dst:
            shutil.copyfileobj(src, dst, 1 << 20)
        out.append(gz)
    return out


def _litdata_item(kind: str, data: Any, i: int) -> dict[str, Any]:
    return {"x": data[i]} if kind == "vec" else {"jpg": data[i]}


def write_litdata(kind: str, data: Any, out: Path) -> float:
    from litdata import optimize

    shutil.rmtree(out, ignore_errors=True)
    fn = partial(_litdata_item, kind, data)
    # one worker (the others write in one process), chunks of 64 MB as litdata's examples
    return timed(
        lambda: optimize(
            fn=fn, inputs=list(range(len(data))), output_dir=str(out), chunk_bytes="64MB",
            num_workers=1, verbose=False, start_method="fork",
        )
    )  # fmt: skip


def write_mds(kind: str, data: Any, out: Path) -> float:
    writer_cls = import_streaming().MDSWriter
    shutil.rmtree(out, ignore_errors=True)
    columns = {"x": f"ndarray:float32:{VEC_DIM}"} if kind == "vec" else {"jpg": "bytes"}

    def write() -> None:
        with writer_cls(out=str(out), columns=columns, size_limit=1 << 26) as sink:
            for i in range(len(data)):
                sink.write({"x": data[i]} if kind == "vec" else {"jpg": data[i]})

    return timed(write)


def du(path: Path | Iterable[str]) -> int:
    files = path.rglob("*") if isinstance(path, Path) else map(Path, path)
    return sum(f.stat().st_size for f in files if f.is_file())


class _Throttled(http.server.SimpleHTTPRequestHandler):
    """Files of `directory`, sent at no more than `rate` bytes/s per request (64 KB at a time)."""

    rate = 10e6

    def copyfile(self, source: Any, outputfile: Any) -> None:
        t0, sent = time.perf_counter(), 0
        while chunk := source.read(1 << 16):
            try:
                outputfile.write(chunk)
            except ConnectionError:  # the reader stopped: ae reads what its plan asks, no more
                return
            sent += len(chunk)
            ahead = sent / self.rate - (time.perf_counter() - t0)
            if ahead > 0:
                time.sleep(ahead)

    def log_message(self, *args: Any) -> None:
        pass


def serve(directory: Path, rate: float) -> tuple[http.server.ThreadingHTTPServer, str]:
    handler = type("Handler", (_Throttled,), {"rate": rate})
    server = http.server.ThreadingHTTPServer(
        ("127.0.0.1", 0), partial(handler, directory=str(directory))
    )
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}"
