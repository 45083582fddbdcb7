"""`--image_decode=gpu` (`ae.data.decoding.gpu_jpeg`): the workers hand JPEG bytes over, the rank
decodes them where Lightning moves the batch, and the result is the CPU path's picture: the same
samples in the same order, the same crops and flips.

nvJPEG itself needs a GPU: here torchvision's `decode_jpeg` is stood in for by TurboJPEG's full
decode on the CPU (`_cpu_decode_jpeg`), so what is checked is ae's part (the bytes' trip, the
crop boxes, the grouped resize, the flips, a failed decode). The CUDA test at the end runs the
real nvJPEG where a GPU and torchvision are there (the GPU lease: docs/BENCHMARKS.md)."""

from __future__ import annotations

import io
import sys
import types
from pathlib import Path

import numpy as np
import pytest
import simplejpeg
import torch
from loguru import logger
from PIL import Image

from ae.config import DataConfig
from ae.data import datamodule as datamodule_module
from ae.data.datamodule import ShardDataModule
from ae.data.decoding.gpu_jpeg import EncodedBatch, decode_on
from ae.data.decoding.jpeg import EncodedJpeg, encoded_jpeg
from ae.data.shards.errors import DataError
from ae.data.shards.writer import npy_bytes, png_bytes, write_shard


def _jpeg(width: int, height: int, seed: int, mode: str = "RGB") -> bytes:
    """A photo-like JPEG: a smooth colour field with a left-right gradient (flips show)."""
    rng = np.random.default_rng(seed)
    grid = Image.fromarray(rng.integers(0, 256, (6, 6, 3), dtype=np.uint8))
    base = np.asarray(grid.resize((width, height), Image.Resampling.BICUBIC), np.float32)
    base[:, :, 0] = np.linspace(0, 255, width)[None, :]
    buf = io.BytesIO()
    Image.fromarray(base.astype(np.uint8)).convert(mode).save(buf, format="JPEG", quality=92)
    return buf.getvalue()


def _cpu_decode_jpeg(data, mode=None, device="cpu"):
    """torchvision.io.decode_jpeg's contract (a tensor or a list of them, uint8 (3, H, W) out,
    RuntimeError on bytes it cannot decode) by TurboJPEG at full size, on the CPU."""
    if isinstance(data, list):
        return [_cpu_decode_jpeg(d, mode, device) for d in data]
    try:
        pixels = simplejpeg.decode_jpeg(bytes(data.numpy()), colorspace="RGB")
    except ValueError as e:
        raise RuntimeError(f"decode failed: {e}") from e
    return torch.from_numpy(pixels).permute(2, 0, 1).contiguous().to(device)


@pytest.fixture
def stand_in_nvjpeg(monkeypatch: pytest.MonkeyPatch) -> None:
    io_module = types.ModuleType("torchvision.io")
    io_module.ImageReadMode = types.SimpleNamespace(RGB="RGB")  # type: ignore[attr-defined]
    io_module.decode_jpeg = _cpu_decode_jpeg  # type: ignore[attr-defined]
    package = types.ModuleType("torchvision")
    package.io = io_module  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "torchvision", package)
    monkeypatch.setitem(sys.modules, "torchvision.io", io_module)
    # the machine's check (a CUDA device): this test decodes on the CPU
    monkeypatch.setattr(datamodule_module, "gpu_decode_problem", lambda: None)


def test_the_gpu_takes_colour_jpegs_from_their_header_and_leaves_the_rest() -> None:
    source = ("s.tar", "k")
    enc = encoded_jpeg(_jpeg(300, 200, 0), "RGB", 64, (0.25, 1.0), True, source)
    assert isinstance(enc, EncodedJpeg)
    assert enc.shape == (3, 64, 64) and enc.box == (25, 0, 200) and enc.flip
    native = encoded_jpeg(_jpeg(48, 40, 0), "RGB", 0, (0.5, 0.5), False, source)
    assert native is not None and native.shape == (3, 40, 48) and native.box == (0, 0, 0)
    # grayscale JPEGs, --channels=1, other formats: the worker decodes them
    assert encoded_jpeg(_jpeg(64, 64, 0, "L"), "RGB", 32, (0.5, 0.5), False, source) is None
    assert encoded_jpeg(_jpeg(64, 64, 0), "L", 32, (0.5, 0.5), False, source) is None
    png = png_bytes(np.zeros((8, 8, 3), np.uint8))
    assert encoded_jpeg(png, "RGB", 32, (0.5, 0.5), False, source) is None
    with pytest.raises(ValueError):  # a damaged header: a bad sample, as on the CPU path
        encoded_jpeg(b"\xff\xd8\xff" + b"\x00" * 40, "RGB", 32, (0.5, 0.5), False, source)


def _shards(tmp_path: Path) -> str:
    """One shard of JPEGs of two sizes (two crop sides in each batch), a grayscale JPEG and a
    PNG among them (decoded by the workers), and a JPEG the decoder refuses past its header."""
    samples = []
    for i in range(24):
        data = _jpeg(96, 64, i) if i % 2 else _jpeg(70, 90, i)
        samples.append({"__key__": f"{i:04d}".encode(), "jpg": data})
    samples[5] = {"__key__": b"0005", "jpg": _jpeg(80, 80, 5, "L")}
    samples[9] = {"__key__": b"0009", "png": png_bytes(np.full((50, 60, 3), 90, np.uint8))}
    path = tmp_path / "train.tar"
    write_shard(path, samples)
    return str(path)


def _module(url: str, decode: str, workers: int) -> ShardDataModule:
    cfg = DataConfig(
        batch_size=8, num_workers=workers, image_size=32, channels=3, random_flip=True,
        image_decode=decode, shuffle_buffer=4,
    )  # fmt: skip
    dm = ShardDataModule(cfg, [url], [url], seed=3)
    dm.setup("fit")
    return dm


def test_the_gpu_path_trains_on_the_cpu_paths_pictures(tmp_path: Path, stand_in_nvjpeg) -> None:
    url = _shards(tmp_path)
    cpu = [b for b in _module(url, "cpu", 2).train_dataloader()]
    dm = _module(url, "gpu", 2)
    encoded = list(dm.train_dataloader())
    assert [len(b) for b in encoded] == [len(b) for b in cpu] == [8, 8, 8]
    assert all(isinstance(b, EncodedBatch) for b in encoded)
    # the grayscale JPEG and the PNG came decoded; every other sample as its bytes
    assert sum(len(b.decoded_at) for b in encoded) == 2
    assert sum(len(b.encoded_at) for b in encoded) == 22
    gpu = [dm.transfer_batch_to_device(b, torch.device("cpu"), 0) for b in encoded]
    for ours, ref in zip(gpu, cpu, strict=True):
        assert ours.shape == ref.shape == (8, 3, 32, 32) and ours.dtype == torch.float32
        assert float(ours.min()) >= 0.0 and float(ours.max()) <= 1.0, (ours.min(), ours.max())
        # the same samples, crops and flips: another sample, crop or a missed flip differs by
        # a tenth or more (the gradient runs left to right); the decodes differ by ~1%
        per_sample = (ours - ref).abs().mean(dim=(1, 2, 3))
        assert float(per_sample.max()) < 0.03, per_sample
    flipped = torch.cat([b.flips for b in encoded])
    assert 0 < int(flipped.sum()) < len(flipped)  # --random_flip drew some of each
    # validation: center crops, same samples, in order
    (val_gpu,) = list(dm.val_dataloader())[:1]
    (val_cpu,) = list(_module(url, "cpu", 0).val_dataloader())[:1]
    val_ours = dm.transfer_batch_to_device(val_gpu, torch.device("cpu"), 0)
    assert float((val_ours - val_cpu).abs().mean(dim=(1, 2, 3)).max()) < 0.03


def test_a_jpeg_the_gpu_refuses_is_named_and_replaced(stand_in_nvjpeg) -> None:
    good = [encoded_jpeg(_jpeg(40, 40, i), "RGB", 16, (0.5, 0.5), False, ("s.tar", f"k{i}"))
            for i in range(3)]  # fmt: skip
    head = good[1].data[: len(good[1].data) // 3]
    broken = EncodedJpeg(head + b"\x00" * 64, good[1].shape, good[1].box, False, ("s.tar", "k1"))
    batch = EncodedBatch.of([good[0], broken, good[2]], (3, 16, 16))
    lines: list[str] = []
    sink = logger.add(lines.append, level="ERROR", format="{message}")
    try:
        out = decode_on(batch, torch.device("cpu"))
    finally:
        logger.remove(sink)
    assert out.shape == (3, 3, 16, 16)
    assert any("k1" in line and "s.tar" in line and "nvJPEG" in line for line in lines), lines
    # replaced by another image of the batch, whole: the batch stays full and finite
    assert any(torch.equal(out[1], out[j]) for j in (0, 2))


def test_a_machine_that_cannot_decode_on_a_gpu_is_told_by_the_flag(tmp_path: Path) -> None:
    url = _shards(tmp_path)
    if torch.cuda.is_available():
        pytest.skip("this machine has a CUDA device")
    with pytest.raises(
        DataError, match=r"image_decode: gpu .* no CUDA device .*--image_decode=cpu"
    ):
        _module(url, "gpu", 0)
    vectors = tmp_path / "v.tar"
    write_shard(vectors, [{"__key__": b"a", "npy": npy_bytes(np.zeros(4, np.float32))}])
    cfg = DataConfig(batch_size=1, image_decode="gpu")
    with pytest.raises(
        DataError, match=r"--image_decode=gpu applies to images; .* \(leave it unset\)"
    ):
        ShardDataModule(cfg, [str(vectors)], None, seed=0).probe()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="nvJPEG needs a CUDA device")
def test_nvjpeg_gives_the_cpu_paths_picture() -> None:
    pytest.importorskip("torchvision.io")
    items = [
        encoded_jpeg(_jpeg(256, 192, i), "RGB", 64, (i / 7, 0.5), bool(i % 2), ("s.tar", str(i)))
        for i in range(8)
    ]
    batch = EncodedBatch.of(items, (3, 64, 64))
    out = decode_on(batch.pin_memory(), torch.device("cuda")).cpu()
    from ae.data.decoding.images import decode_image

    for i, item in enumerate(items):
        ref = decode_image(item.data, "RGB", 64, (i / 7, 0.5), bool(i % 2))
        assert float((out[i] - torch.from_numpy(ref)).abs().mean()) < 0.03
