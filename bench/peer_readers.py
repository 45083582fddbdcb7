"""bench.peers' readers: each library's intended PyTorch path over the same data (ae's data module,
webdataset's pipeline, litdata's and MosaicML's streaming datasets), and the JPEG decodes that
make the image rows fair (`full`, `draft`, `turbo`). Each reader returns a loader to iterate
epoch after epoch, and its set_epoch; `variants` names the rows of a dataset."""

from __future__ import annotations

import io
import math
from collections.abc import Callable, Iterable, Iterator
from functools import partial
from typing import Any

import numpy as np
import simplejpeg
import torch
from PIL import Image
from torch.utils.data import DataLoader

from ae.config import DataConfig
from ae.data.datamodule import ShardDataModule
from ae.data.decoding.images import fit, to_array
from bench.peer_data import JPG_SIZE, SHUFFLE_BUFFER, import_streaming


def full_decode(data: bytes) -> np.ndarray:
    """A peer's plain JPEG path: Pillow decodes the whole picture; then the same resize and crop
    as ae's (`fit`), so the only difference left is the draft."""
    with Image.open(io.BytesIO(data)) as img:
        return to_array(fit(img.convert("RGB"), JPG_SIZE))


def draft_decode(data: bytes) -> np.ndarray:
    """The same decode work as ae's (`ae.data.decoding.images.decode_image` with a size): Pillow's
    `draft()` at the largest scale that keeps 64x64 (1/4 here), the drafted picture's extent,
    then the same resize and crop -- written out here, as a peer's user would, so that what ae
    saves in its own pipeline around the decode counts for ae."""
    with Image.open(io.BytesIO(data)) as img:
        drafted = img.draft(None, (JPG_SIZE, JPG_SIZE))
        extent = drafted[1][2:] if drafted is not None else None
        return to_array(fit(img.convert("RGB"), JPG_SIZE, extent=extent))


def turbo_decode(data: bytes) -> np.ndarray:
    """ae's decoder library given to a peer: TurboJPEG (`simplejpeg`, an ae dependency) at the
    same 1/4 scale as the draft, then the same resize and crop -- so that what is left between
    ae and the peer is the pipeline around the decode."""
    pixels = simplejpeg.decode_jpeg(data, colorspace="RGB", min_height=JPG_SIZE, min_width=JPG_SIZE)
    return to_array(fit(Image.fromarray(pixels), JPG_SIZE))


DECODES = {"full": full_decode, "draft": draft_decode, "turbo": turbo_decode}
Reader = tuple[Iterable[Any], Callable[[int], None]]


def _loader_kw(workers: int) -> dict[str, Any]:
    return {"num_workers": workers, "persistent_workers": workers > 0}


def _ae_module(info: dict, kind: str, workers: int, image_decode: str = "cpu") -> ShardDataModule:
    cfg = DataConfig(
        batch_size=info["batch"],
        num_workers=workers,
        image_size=JPG_SIZE if kind == "jpg" else 0,
        count_cache=info["count_cache"],
        image_decode=image_decode,
    )
    urls = info["tar_urls"]
    dm = ShardDataModule(cfg, urls, urls, seed=0)
    dm.setup("fit")
    return dm


def read_ae(info: dict, kind: str, workers: int, _: str) -> Reader:
    dm = _ae_module(info, kind, workers)
    return dm.train_dataloader(), dm.set_epoch


GPU = torch.device("cuda")  # where the ae_gpu row decodes


class _OnDevice:
    """A loader's batches as the rank trains on them: moved (and for `--image_decode=gpu`,
    decoded) by the data module's `transfer_batch_to_device`, each batch waited for."""

    def __init__(self, dm: ShardDataModule, device: torch.device) -> None:
        self.dm, self.device, self.loader = dm, device, dm.train_dataloader()

    def __iter__(self) -> Iterator[torch.Tensor]:
        for batch in self.loader:
            batch = self.dm.transfer_batch_to_device(batch, self.device, 0)
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            yield batch


def read_ae_gpu(info: dict, kind: str, workers: int, _: str) -> Reader:
    """ae with `--image_decode=gpu`: the workers read, nvJPEG on the GPU decodes."""
    on_device = _OnDevice(_ae_module(info, kind, workers, "gpu"), GPU)
    return on_device, on_device.dm.set_epoch


def gpu_pixel_difference(info: dict, device: torch.device) -> dict[str, float]:
    """How far `--image_decode=gpu`'s pictures are from the CPU path's: the validation batches
    (center crops, the same samples in order) of both, in 1/255 steps, and their PSNR."""
    gpu, cpu = (_ae_module(info, "jpg", 0, decode) for decode in ("gpu", "cpu"))
    diffs = []
    for ours, ref in zip(gpu.val_dataloader(), cpu.val_dataloader(), strict=True):
        diffs.append((gpu.transfer_batch_to_device(ours, device, 0).cpu() - ref).abs())
    diff = torch.cat(diffs)
    mse = float(diff.square().mean())
    return {
        "images": len(diff),
        "mean_abs_255": float(diff.mean()) * 255,
        "p99_abs_255": float(np.percentile(diff.numpy(), 99)) * 255,
        "max_abs_255": float(diff.max()) * 255,
        "psnr_db": 10 * math.log10(1.0 / mse) if mse else math.inf,
    }


def _wds_jpg(decode: Callable[[bytes], np.ndarray], sample: tuple) -> tuple:
    return (decode(sample[0]),)


def read_webdataset(info: dict, kind: str, workers: int, variant: str) -> Reader:
    import webdataset as wds

    urls = info["tar_urls"]
    ds = wds.WebDataset(urls, shardshuffle=len(urls), workersplitter=wds.split_by_worker)
    ds = ds.shuffle(SHUFFLE_BUFFER)
    if kind == "vec":
        ds = ds.decode().to_tuple("npy").batched(info["batch"])
    else:  # raw bytes, then the variant's decode
        ds = ds.to_tuple("jpg").map(partial(_wds_jpg, DECODES[variant])).batched(info["batch"])
    loader = DataLoader(ds, batch_size=None, **_loader_kw(workers))
    return loader, lambda epoch: None  # shardshuffle reseeds every epoch itself


class _JpgTransform:
    """litdata / MosaicML item -> the decoded image (a class: picklable for the workers)."""

    def __init__(self, decode: Callable[[bytes], np.ndarray]) -> None:
        self.decode = decode

    def __call__(self, item: dict[str, Any]) -> np.ndarray:
        return self.decode(item["jpg"])


def read_litdata(info: dict, kind: str, workers: int, variant: str) -> Reader:
    from litdata import StreamingDataLoader, StreamingDataset

    kw: dict[str, Any] = {"shuffle": True, "seed": 0}
    if variant == "item":  # item by item, a full in-chunk shuffle
        kw |= {"batch_decode": 0, "item_shuffle_window": "full"}
    if kind == "jpg":
        kw["transform"] = _JpgTransform(DECODES[variant])
    ds = StreamingDataset(info["dirs"]["litdata"], **kw)
    loader = StreamingDataLoader(ds, batch_size=info["batch"], **_loader_kw(workers))
    return loader, lambda epoch: None  # the loader counts its epochs


def read_mosaicml(info: dict, kind: str, workers: int, variant: str) -> Reader:
    streaming = import_streaming()
    streaming.base.util.clean_stale_shared_memory()
    batch = info["batch"]

    class Dataset(streaming.StreamingDataset):
        def __getitem__(self, i: int) -> Any:
            item = super().__getitem__(i)
            return item["x"] if kind == "vec" else DECODES[variant](item["jpg"])

    ds = Dataset(local=info["dirs"]["mds"], shuffle=True, shuffle_seed=0, batch_size=batch)
    loader = DataLoader(ds, batch_size=batch, **_loader_kw(workers))
    return loader, lambda epoch: None  # it counts its epochs itself


READERS: dict[str, Callable[[dict, str, int, str], Reader]] = {
    "ae": read_ae,
    "ae_gpu": read_ae_gpu,
    "webdataset": read_webdataset,
    "litdata": read_litdata,
    "mosaicml": read_mosaicml,
}


PACKAGE = {"webdataset": "webdataset", "litdata": "litdata", "mosaicml": "mosaicml-streaming"}


def variants(kind: str, peers: dict[str, str], gpu: bool) -> list[tuple[str, str, str]]:
    """(row name, reader, variant) of one dataset, for the installed `peers`; `gpu`: with ae's
    `--image_decode=gpu` row (JPEGs, where a CUDA device and torchvision are there)."""
    return [
        row for row in _variants(kind, gpu) if row[1] not in PACKAGE or PACKAGE[row[1]] in peers
    ]


def _variants(kind: str, gpu: bool) -> list[tuple[str, str, str]]:
    if kind == "vec":
        return [
            ("ae", "ae", ""),
            ("webdataset", "webdataset", ""),
            ("litdata", "litdata", ""),
            ("litdata_item", "litdata", "item"),
            ("mosaicml", "mosaicml", ""),
        ]
    rows = [("ae", "ae", "")] + ([("ae_gpu", "ae_gpu", "")] if gpu else [])
    for peer in ("webdataset", "litdata", "mosaicml"):
        rows += [(f"{peer}_full", peer, "full"), (f"{peer}_draft", peer, "draft")]
    return [*rows, ("litdata_turbo", "litdata", "turbo")]  # the fastest peer, ae's decoder
