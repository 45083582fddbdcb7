"""bench/gpu_proof.py's `data` part: 64-dim float32 vector shards (ae's writer, or the same bytes
built as whole arrays) and 64x64 RGB photo crop shards, written in a process pool."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from bench.gpu_runner import Proof, ae_names

DIM = 64


def vec_array(shard: int, per_shard: int, dim: int = DIM) -> Any:
    """Shard `shard`'s vectors, regenerated anywhere from the same seed."""
    import numpy as np

    return np.random.default_rng(1000 + shard).random((per_shard, dim), dtype=np.float32)


def _vec_samples(a: Any, first: int, arr: Any) -> Iterator[dict[str, bytes]]:
    return (
        {"__key__": f"{first + j:09d}".encode(), "npy": a.npy_bytes(row)}
        for j, row in enumerate(arr)
    )


def fast_vec_shard(a: Any, path: Path, first: int, arr: Any) -> None:
    """The shard ae's writer makes of `arr` (keys first.. as 9 digits, one `npy` member each),
    built as whole arrays: every member's header is the writer's own header of the first
    sample with the name and checksum replaced (ae's writer: ~40 us a sample; this: ~0.1 us).
    `check_fast_writer` compares the bytes with ae's writer."""
    import numpy as np

    n = len(arr)
    probe = path.with_name(f".probe-{path.name}")
    a.write_shard(probe, _vec_samples(a, first, arr[:1]))
    raw = probe.read_bytes()
    for p in probe.parent.glob(f"{probe.name}*"):
        p.unlink()
    npy = a.npy_bytes(arr[0])
    assert len(npy) <= 512 and len(npy) - arr[0].nbytes == 128, "one 512-byte block a sample"
    headers = np.tile(np.frombuffer(raw[:512], np.uint8), (n, 1))
    keys = np.arange(first, first + n, dtype=np.int64)[:, None]
    headers[:, :9] = keys // 10 ** np.arange(8, -1, -1) % 10 + ord("0")
    headers[:, 148:156] = ord(" ")  # the checksum counts its own field as spaces
    chk = headers.sum(axis=1, dtype=np.int64)[:, None]
    headers[:, 148:154] = chk // 8 ** np.arange(5, -1, -1) % 8 + ord("0")
    headers[:, 154], headers[:, 155] = 0, ord(" ")
    data = np.zeros((n, 512), np.uint8)
    data[:, :128] = np.frombuffer(npy[:128], np.uint8)
    data[:, 128 : 128 + arr[0].nbytes] = np.ascontiguousarray(arr).view(np.uint8).reshape(n, -1)
    body = np.concatenate([headers, data], axis=1).tobytes() + bytes(1024)
    body += bytes(-len(body) % 10240)  # tarfile pads the archive to its 20-block records
    tmp = path.with_name(f".tmp-{path.name}")
    tmp.write_bytes(body)
    tmp.replace(path)
    a.write_index(path, n, list(range(0, n * 1024, 1024)))


def check_fast_writer(a: Any, root: Path) -> bool:
    """`fast_vec_shard` and ae's writer give the same bytes (shard and index sidecar)."""
    arr = vec_array(7, 300)
    root.mkdir(parents=True, exist_ok=True)
    a.write_shard(root / "ae.tar", _vec_samples(a, 5000, arr))
    fast_vec_shard(a, root / "fast.tar", 5000, arr)
    same = (root / "ae.tar").read_bytes() == (root / "fast.tar").read_bytes()
    idx = [(root / f"{n}.tar.idx").read_text() for n in ("ae", "fast")]
    shutil.rmtree(root)
    return same and idx[0] == idx[1]


def _write_vec_shard(out: str, i: int, per_shard: int, fast: bool) -> None:
    a = ae_names()
    path, arr = Path(out) / f"vec-{i:06d}.tar", vec_array(i, per_shard)
    if fast:
        fast_vec_shard(a, path, i * per_shard, arr)
    else:
        a.write_shard(path, _vec_samples(a, i * per_shard, arr))


_CROPS: list[Any] = []  # the photo crops, shared with forked shard writers


def _write_photo_shard(path: str, start: int, indices: list[int]) -> None:
    a = ae_names()
    samples = (
        {"__key__": f"{start + j:09d}".encode(), "png": a.png_bytes(_CROPS[k])}
        for j, k in enumerate(indices)
    )
    a.write_shard(Path(path), samples)


def _pool(jobs: list[tuple], fn: Callable) -> None:
    import multiprocessing

    with multiprocessing.get_context("fork").Pool(min(len(jobs), os.cpu_count() or 1)) as pool:
        pool.starmap(fn, jobs)


def part_data(p: Proof, z: SimpleNamespace) -> None:
    a = p.a
    data = p.work / "data"
    t0 = time.monotonic()
    vec = data / f"vec-{z.vec_shards}x{z.vec_per_shard}"
    fast = check_fast_writer(a, data / "writer-check")
    if not (vec / "DONE").exists():
        shutil.rmtree(vec, ignore_errors=True)
        vec.mkdir(parents=True)
        jobs = [(str(vec), i, z.vec_per_shard, fast) for i in range(z.vec_shards)]
        _pool(jobs, _write_vec_shard)
        (vec / "DONE").write_text("")
    p.specs = SimpleNamespace(vec=str(vec / f"vec-{{000000..{z.vec_shards - 1:06d}}}.tar"))
    vec_s = time.monotonic() - t0
    source = _photos(p, a)
    t1 = time.monotonic()
    photos = data / f"photos-x{z.photo_copies}"
    if not (photos / "DONE").exists():
        shutil.rmtree(photos, ignore_errors=True)
        photos.mkdir(parents=True)
        _CROPS.clear()
        split: dict[str, list[int]] = {"train": [], "val": []}
        from PIL import Image

        for path in source["paths"]:
            part = "val" if Path(path).name.removeprefix("skimage_") in a.VAL_PHOTOS else "train"
            with Image.open(path) as im:
                crops = a.photo_crops(im.convert("RGB"), 64)
            split[part] += range(len(_CROPS), len(_CROPS) + len(crops))
            _CROPS.extend(crops)
        train, val = split["train"], split["val"]
        big = train * z.photo_copies
        per = -(-len(big) // 16)
        jobs = [
            (str(photos / f"train-{i:06d}.tar"), i * 144, train[i * 144 : (i + 1) * 144])
            for i in range(-(-len(train) // 144))
        ]
        jobs.append((str(photos / "val-000000.tar"), 10**6, val))
        jobs += [
            (str(photos / f"big-{i:06d}.tar"), 2 * 10**6 + i * per, big[i * per : (i + 1) * per])
            for i in range(16)
            if big[i * per : (i + 1) * per]
        ]
        _pool(jobs, _write_photo_shard)
        (photos / "DONE").write_text(
            json.dumps({"train": len(train), "val": len(val), "big": len(big)})
        )
    counts = json.loads((photos / "DONE").read_text())
    p.specs.train = str(photos / "train-*.tar")
    p.specs.val = str(photos / "val-*.tar")
    p.specs.big = str(photos / "big-*.tar")
    p.put(
        "data",
        "vec",
        {
            "spec": p.specs.vec,
            "samples": z.vec_shards * z.vec_per_shard,
            "dim": DIM,
            "seconds": round(vec_s, 1),
            "fast_writer_same_bytes_as_ae_writer": fast,
        },
    )
    p.put(
        "data",
        "photos",
        {
            "source": source["source"],
            "crops": counts,
            "size": 64,
            "seconds": round(time.monotonic() - t1, 1),
        },
    )


def _photos(p: Proof, a: Any) -> dict[str, Any]:
    """The 20 photographs: `--photos` (a folder that holds them, checked by sha256), else
    `bench.real_images` (an installed scikit-image with the same files, or the pinned wheel
    from PyPI), else whatever scikit-image is installed (other bytes), else nothing."""
    dest = Path(p.args.photos) if p.args.photos else p.work / "photos"
    try:
        return {"paths": [str(x) for x in a.real_photos(dest)], "source": f"pinned ({dest})"}
    except Exception as e:
        spec = importlib.util.find_spec("skimage")
        if spec is None or not spec.submodule_search_locations:
            raise RuntimeError(f"no photographs: {e}") from e
        root = Path(next(iter(spec.submodule_search_locations))) / "data"
        paths = [str(root / n) for n in a.SKIMAGE.images if (root / n).is_file()]
        if len(paths) < 8:
            raise RuntimeError(f"no photographs: {e}; installed skimage has {len(paths)}") from e
        return {"paths": paths, "source": f"installed skimage, unpinned ({root})"}
