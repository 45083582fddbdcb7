"""Mid-epoch resume of the train stream: exactly the batches an uninterrupted epoch had left."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from ae.data.decode import SampleDecoder
from ae.data.header_walk import count_samples
from ae.data.resume import ResumableLoader
from ae.data.spec import resolve_shards
from ae.data.stream import ShardStream, resumed_slot, worker_skip
from ae.data.writer import png_bytes, write_shard
from tests.support.shards import vector_decoder


def test_worker_skip_follows_round_robin() -> None:
    # batches 0..6 of a rank come from workers 0,1,2,0,1,2,0
    assert [worker_skip(7, 3, w) for w in range(3)] == [3, 2, 2]
    assert [worker_skip(0, 3, w) for w in range(3)] == [0, 0, 0]
    assert worker_skip(5, 0, 0) == 5  # in-process loading
    # resuming at batch 7 = slot 1's turn: the new iterator's worker 0 reads slot 1
    assert [resumed_slot(7, 3, w) for w in range(3)] == [1, 2, 0]


def _stream(spec: str, workers: int) -> ShardStream:
    urls, _ = resolve_shards(spec, spec)
    return ShardStream(
        split="train", urls=urls, counts=[count_samples(u) for u in urls],
        decoder=vector_decoder(16), batch_size=4, rank=1, world_size=2,
        num_workers=workers, shuffle=True, shuffle_buffer=16, seed=3, epoch=2,
    )  # fmt: skip


def _batches(loader: ResumableLoader) -> list[torch.Tensor]:
    return [b.clone() for b in loader]


@pytest.mark.parametrize("workers", [0, 2])
def test_resumed_epoch_yields_the_rest_of_the_same_epoch(make_shards, workers: int) -> None:
    spec = make_shards([30, 25, 20], name="train")
    loader = ResumableLoader(_stream(spec, workers), batch_size=None, num_workers=workers)
    full = _batches(loader)
    assert len(full) == len(loader) == 9
    assert loader.state_dict() == {"epoch": 2, "batches": 9}
    for k in (1, 4, 5):
        resumed = ResumableLoader(_stream(spec, workers), batch_size=None, num_workers=workers)
        resumed.load_state_dict({"epoch": 2, "batches": k})
        rest = _batches(resumed)
        assert len(rest) == 9 - k
        assert all(torch.equal(a, b) for a, b in zip(rest, full[k:], strict=True))
        assert resumed.state_dict() == {"epoch": 2, "batches": 9}
        assert len(_batches(resumed)) == 9  # the skip applies to the resumed epoch only


def test_state_saved_after_the_last_batch_resumes_at_the_next_epoch(make_shards) -> None:
    loader = ResumableLoader(_stream(make_shards([40], name="train"), 0), batch_size=None)
    loader.load_state_dict({"epoch": 2, "batches": len(loader)})
    assert loader.dataset.epoch == 3
    assert len(_batches(loader)) == len(loader)


def _photo_like_shards(tmp_path: Path) -> list[str]:
    """RGB PNGs of many sizes: random crops and flips are drawn for each of them."""
    rng = np.random.default_rng(0)
    urls = []
    for s, n in enumerate((14, 11, 13)):
        samples = []
        for i in range(n):
            h, w = (int(v) for v in rng.integers(9, 30, 2))
            pixels = rng.integers(0, 256, (h, w, 3), dtype=np.uint8)
            samples.append({"__key__": f"{s}-{i:04d}".encode(), "png": png_bytes(pixels)})
        write_shard(tmp_path / f"img-{s:06d}.tar", samples)
        urls.append(str(tmp_path / f"img-{s:06d}.tar"))
    return urls


@pytest.mark.parametrize("workers", [0, 2])
def test_resume_with_random_crops_and_flips_is_exact(tmp_path: Path, workers: int) -> None:
    urls = _photo_like_shards(tmp_path)
    decoder = SampleDecoder((("png", None),), "image", (3, 8, 8), image_size=8, random_flip=True)

    def loader() -> ResumableLoader:
        stream = ShardStream(
            split="train", urls=urls, counts=[count_samples(u) for u in urls], decoder=decoder,
            batch_size=3, rank=0, world_size=2, num_workers=workers, shuffle=True,
            shuffle_buffer=8, seed=3, epoch=1, augment=True,
        )  # fmt: skip
        return ResumableLoader(stream, batch_size=None, num_workers=workers)

    full = _batches(loader())
    assert len(full) == 6
    for k in (1, 4):
        resumed = loader()
        resumed.load_state_dict({"epoch": 1, "batches": k})
        rest = _batches(resumed)
        assert all(torch.equal(a, b) for a, b in zip(rest, full[k:], strict=True))
    # the crops were random ones: center crops give other batches of the same samples
    center = loader()
    center.dataset.augment = False
    assert not any(torch.equal(a, b) for a, b in zip(_batches(center), full, strict=True))
