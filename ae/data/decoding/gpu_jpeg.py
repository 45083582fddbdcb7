"""JPEGs decoded on the rank's GPU (`--image_decode=gpu`): nvJPEG through torchvision, a batch
at a time, then cropped, resized and flipped there.

On the CPU the decode is ~85-90% of an image's time in the input pipeline (TurboJPEG at 1/4
scale: ~330 us of CPU per 256 -> 64 image, `ae.data.decoding.jpeg`), and the peers spend the same
(docs/BENCHMARKS.md, `peers`). nvJPEG decodes a batch of such images in ~30 us an image. So with
this flag the loader's workers do no decode at all for the JPEGs it can take: each sample leaves
the worker as its bytes (`ae.data.decoding.jpeg.EncodedJpeg`, read from the header only: its
size and the crop box of its random or center crop), a batch as one `EncodedBatch` (the bytes
end to end, their offsets, the boxes and flips), and the rank turns it into the float batch on
its device in the data module's `transfer_batch_to_device` (`decode_on`), where Lightning moves
every batch.

Which samples take this path (the rest are decoded by the workers as before and travel in the
same batch, already decoded): baseline or progressive YCbCr JPEGs to RGB. Grayscale, CMYK and
Adobe JPEGs, other formats, and `--channels=1` stay on the CPU.

The pixels are the same picture as the CPU path's, not the same bits: the CPU decodes at Pillow's
draft scale and resizes with Pillow's bilinear filter; here the full picture is decoded and
resized by torch's antialiased bilinear `interpolate`, the crop's corner rounded to a whole
source pixel. docs/BENCHMARKS.md has the measured difference.

A JPEG whose header reads but whose data nvJPEG refuses makes the batch's decode fail: the batch
is then decoded image by image, and each image that fails is logged (BAD_SAMPLE, naming its shard
and key) and replaced by another image of the batch, so every rank still trains on a full batch.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from loguru import logger

from ae.data.decoding.jpeg import EncodedJpeg
from ae.log_lines import BAD_SAMPLE


@dataclass
class EncodedBatch:
    """A batch some of whose samples are JPEG bytes for the GPU (`encoded`) and the rest already
    decoded arrays (`decoded`, at batch positions `decoded_at`). Tensors, so that it travels from
    a worker through shared memory like any batch, and the encoded samples' names."""

    shape: tuple[int, ...]  # (N, C, H, W) once decoded
    data: torch.Tensor  # uint8: every encoded sample's bytes, end to end
    offsets: torch.Tensor  # int64 (E + 1,): where each one's bytes start, then the end
    encoded_at: torch.Tensor  # int64 (E,): their positions in the batch
    boxes: torch.Tensor  # int64 (E, 3): (x0, y0, side)
    flips: torch.Tensor  # bool (E,)
    sources: list[tuple[str, str]]  # (E,) (url, key)
    decoded: torch.Tensor  # float32 (N - E, C, H, W)
    decoded_at: torch.Tensor  # int64 (N - E,)

    @classmethod
    def of(cls, items: Sequence[np.ndarray | EncodedJpeg], shape: tuple[int, ...]) -> EncodedBatch:
        """The batch of `items` (each of `shape`: EncodedJpeg or a decoded float32 array)."""
        encoded = [(i, x) for i, x in enumerate(items) if isinstance(x, EncodedJpeg)]
        decoded = [(i, x) for i, x in enumerate(items) if not isinstance(x, EncodedJpeg)]
        sizes = [len(x.data) for _, x in encoded]
        # joined straight into a writable buffer: one copy of the bytes, which torch shares
        data = np.frombuffer(bytearray().join(x.data for _, x in encoded), dtype=np.uint8)
        arrays = np.stack([x for _, x in decoded]) if decoded else np.empty((0, *shape), np.float32)
        return cls(
            shape=(len(items), *shape),
            data=torch.from_numpy(data),
            offsets=torch.tensor([0, *itertools.accumulate(sizes)], dtype=torch.int64),
            encoded_at=torch.tensor([i for i, _ in encoded], dtype=torch.int64),
            boxes=torch.tensor([x.box for _, x in encoded], dtype=torch.int64).reshape(-1, 3),
            flips=torch.tensor([x.flip for _, x in encoded], dtype=torch.bool),
            sources=[x.source for _, x in encoded],
            decoded=torch.from_numpy(arrays),
            decoded_at=torch.tensor([i for i, _ in decoded], dtype=torch.int64),
        )

    def __len__(self) -> int:
        return self.shape[0]

    def _tensors(self) -> tuple[str, ...]:
        return ("data", "offsets", "encoded_at", "boxes", "flips", "decoded", "decoded_at")

    def share_memory_(self) -> EncodedBatch:
        """Its tensors in shared memory (a worker's hand-over: `into_shared_memory`)."""
        for name in self._tensors():
            getattr(self, name).share_memory_()
        return self

    def pin_memory(self) -> EncodedBatch:
        """A copy in pinned memory (the DataLoader's pin step calls it, as for a tensor)."""
        pinned = {name: getattr(self, name).pin_memory() for name in self._tensors()}
        return EncodedBatch(shape=self.shape, sources=self.sources, **pinned)


def gpu_decode_problem() -> str | None:
    """Why this machine cannot decode JPEGs on its GPU, or None when it can."""
    if not torch.cuda.is_available():
        return "no CUDA device is visible"
    try:
        from torchvision.io import decode_jpeg  # noqa: F401  (nvJPEG, torchvision's CUDA build)
    except Exception as e:  # not installed, or built for another torch
        return (
            f"torchvision does not import ({type(e).__name__}: {e}); install the torchvision "
            "built for this torch"
        )
    return None


def decode_on(batch: EncodedBatch, device: torch.device) -> torch.Tensor:
    """The float32 (N, C, H, W) batch in [0, 1] on `device` (a CUDA device)."""
    out = torch.empty(batch.shape, dtype=torch.float32, device=device)
    if len(batch.decoded_at):
        out[batch.decoded_at.to(device)] = batch.decoded.to(device, non_blocking=True)
    if not len(batch.encoded_at):
        return out
    images, use = _decode_jpegs(batch, device)
    height, width = batch.shape[2:]
    boxes = [tuple(box) for box in batch.boxes.tolist()]
    groups: dict[int, list[int]] = {}  # crops of one side stack: one resize for all of them
    for j in range(len(images)):
        groups.setdefault(boxes[use[j]][2], []).append(j)
    flips = batch.flips.to(device, non_blocking=True)
    at = batch.encoded_at.to(device, non_blocking=True)
    for side, members in groups.items():
        crops = []
        for j in members:
            image = images[use[j]]
            x0, y0, _ = boxes[use[j]]
            crops.append(image[:, y0 : y0 + side, x0 : x0 + side] if side else image)
        pixels = torch.stack(crops).float()
        if pixels.shape[2:] != (height, width):
            pixels = torch.nn.functional.interpolate(
                pixels, size=(height, width), mode="bilinear", antialias=True, align_corners=False
            )
        index = torch.tensor(members, device=device)
        pixels = torch.where(flips[index, None, None, None], pixels.flip(-1), pixels)
        out[at[index]] = pixels.div_(255.0).clamp_(0.0, 1.0)  # the resize may overshoot by ulps
    return out


def _decode_jpegs(
    batch: EncodedBatch, device: torch.device
) -> tuple[list[torch.Tensor | None], list[int]]:
    """Every encoded sample decoded to uint8 (3, h, w) on `device` (one batched nvJPEG call, or
    image by image when it fails), and for each the one to train on: itself, or for one that
    failed (logged as a bad sample) another image of the batch."""
    from torchvision.io import ImageReadMode, decode_jpeg

    datas = list(torch.tensor_split(batch.data, batch.offsets[1:-1]))
    try:
        images = decode_jpeg(datas, mode=ImageReadMode.RGB, device=device)
        return images, list(range(len(images)))
    except (RuntimeError, ValueError):  # one image it refused fails the whole call
        pass
    images = []
    for data, (url, key) in zip(datas, batch.sources, strict=True):
        try:
            images.append(decode_jpeg(data, mode=ImageReadMode.RGB, device=device))
        except (RuntimeError, ValueError) as e:
            logger.error(BAD_SAMPLE.format(key=key, url=url, reason=f"nvJPEG: {e}"))
            images.append(None)
    good = [j for j, image in enumerate(images) if image is not None]
    if not good:
        raise RuntimeError(f"nvJPEG decoded none of the {len(images)} JPEGs of a batch")
    return images, [j if images[j] is not None else good[j % len(good)] for j in range(len(images))]
