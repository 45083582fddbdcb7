"""Mid-epoch resume of the train stream: exactly the batches an uninterrupted epoch had left."""

from __future__ import annotations

import itertools
from collections.abc import Iterable
from pathlib import Path

import numpy as np
import pytest
import torch

from ae.data.decoding.decode import SampleDecoder
from ae.data.planning.plan import plan_epoch
from ae.data.shards.spec import resolve_shards
from ae.data.shards.tar_header_count import count_samples
from ae.data.shards.writer import png_bytes, write_shard
from ae.data.stream.resume import ResumableLoader
from ae.data.stream.resume_arithmetic import resumed_slot, worker_skip
from ae.data.stream.shard_stream import ShardStream
from tests.support.shards import id_samples, vector_decoder


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


@pytest.mark.parametrize(("workers", "ahead"), [(0, False), (0, True), (2, False)])
def test_resumed_epoch_yields_the_rest_of_the_same_epoch(
    make_shards, workers: int, ahead: bool
) -> None:
    """Also read ahead on a thread (what a GPU rank without workers does): the same batches."""
    spec = make_shards([30, 25, 20], name="train")

    def train_loader() -> ResumableLoader:
        loader = ResumableLoader(_stream(spec, workers), batch_size=None, num_workers=workers)
        loader.reads_ahead = ahead
        return loader

    loader = train_loader()
    full = _batches(loader)
    assert len(full) == len(loader) == 9
    for k in (1, 4, 5):
        resumed = train_loader()
        resumed.resume(loader.position(k))
        assert len(resumed) == 9  # Lightning counts the epoch's batches on from k
        rest = _batches(resumed)
        assert len(rest) == 9 - k
        assert all(torch.equal(a, b) for a, b in zip(rest, full[k:], strict=True))
        assert len(_batches(resumed)) == 9  # the skip applies to the resumed epoch only


def test_state_saved_after_the_last_batch_resumes_at_the_next_epoch(make_shards) -> None:
    loader = ResumableLoader(_stream(make_shards([40], name="train"), 0), batch_size=None)
    loader.resume(loader.position(len(loader)))
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
        resumed.resume(resumed.position(k))
        rest = _batches(resumed)
        assert all(torch.equal(a, b) for a, b in zip(rest, full[k:], strict=True))
    # the crops were random ones: center crops give other batches of the same samples
    center = loader()
    center.dataset.augment = False
    assert not any(torch.equal(a, b) for a, b in zip(_batches(center), full, strict=True))


def _id_shards(tmp_path: Path, sizes: list[int]) -> tuple[list[str], list[int]]:
    urls, start = [], 0
    for i, n in enumerate(sizes):
        write_shard(tmp_path / f"ids-{i:06d}.tar", id_samples(n, start=start))
        urls.append(str(tmp_path / f"ids-{i:06d}.tar"))
        start += n
    return urls, sizes


def _id_loaders(
    urls: list[str],
    counts: list[int],
    world: int,
    workers: int,
    batch: int,
    mode: str = "drop",
    seed: int = 5,
) -> list[ResumableLoader]:
    """One train loader per rank of a run with these settings (epoch 1)."""
    common = dict(
        split="train", urls=urls, counts=counts, decoder=vector_decoder(4), batch_size=batch,
        world_size=world, num_workers=workers, mode=mode, shuffle=True, shuffle_buffer=8,
        seed=seed, epoch=1,
    )  # fmt: skip
    streams = [ShardStream(rank=rank, **common) for rank in range(world)]
    return [ResumableLoader(s, batch_size=None, num_workers=workers) for s in streams]


def _ids(batches: Iterable[torch.Tensor]) -> list[int]:
    return [int(v) for batch in batches for v in batch[:, 0]]


# (world size, workers, batch size) before -> after: ranks 2 -> 1 and 1 -> 2, another batch
# size, other workers, and all at once.
CHANGES = [
    ((2, 0, 4), (1, 0, 4)),
    ((1, 0, 4), (2, 0, 4)),
    ((2, 0, 4), (2, 0, 7)),
    ((1, 2, 3), (1, 1, 3)),
    ((2, 2, 5), (1, 0, 3)),
]


@pytest.mark.parametrize(("old", "new"), CHANGES)
@pytest.mark.parametrize("mode", ["drop", "pad"])
def test_resume_with_other_settings_trains_each_remaining_sample_once(
    tmp_path: Path, old: tuple[int, int, int], new: tuple[int, int, int], mode: str
) -> None:
    urls, counts = _id_shards(tmp_path, [23, 17, 30])
    first = _id_loaders(urls, counts, *old, mode=mode)
    k = len(first[0]) // 2
    trained = [i for loader in first for i in _ids(itertools.islice(iter(loader), k))]
    state = first[0].position(k)
    resumed = _id_loaders(urls, counts, *new, mode=mode)
    for loader in resumed:
        loader.resume(state)
    plan = resumed[0].dataset.plan()
    assert len(resumed[0]) == k + plan.batches_per_rank  # Lightning counts on from k
    rest = [i for loader in resumed for i in _ids(loader)]
    assert len(rest) == new[0] * plan.batches_per_rank * new[2]
    seen = trained + rest
    untrained = set(range(70)) - set(trained)
    assert plan.total_samples == len(untrained)  # the rest of the epoch is what was left
    if mode == "drop":  # each once; the new split drops fewer than one round of batches
        assert len(set(seen)) == len(seen)
        assert len(untrained - set(rest)) == plan.dropped < new[0] * new[2]
    else:  # every sample, the rest of the epoch repeated only to fill the last batches
        assert set(seen) == set(range(70))
        assert not set(trained) & set(rest)
        assert len(rest) - len(set(rest)) == plan.repeated
    # the epoch after is whole again, in the new settings
    assert resumed[0].dataset.epoch == 1
    resumed[0].dataset.epoch = 2
    assert (
        len(resumed[0])
        == plan_epoch(
            counts, world_size=new[0], num_workers=new[1], batch_size=new[2], mode=mode
        ).batches_per_rank
    )


def test_resume_after_the_last_batch_with_other_settings_starts_the_next_epoch(
    tmp_path: Path,
) -> None:
    urls, counts = _id_shards(tmp_path, [23, 17, 30])
    first = _id_loaders(urls, counts, 2, 0, 4)
    state = first[0].position(len(first[0]))
    resumed = _id_loaders(urls, counts, 1, 0, 6)[0]
    resumed.resume(state)
    assert resumed.dataset.epoch == 2
    assert len(resumed) == 70 // 6  # the whole epoch, from its first batch
    fresh = _id_loaders(urls, counts, 1, 0, 6)[0]
    fresh.dataset.epoch = 2
    assert _ids(resumed) == _ids(fresh)


def test_a_resumed_rest_resumed_again_with_other_settings(tmp_path: Path) -> None:
    """Stopped twice in one epoch, with other settings each time: still each sample once."""
    urls, counts = _id_shards(tmp_path, [23, 17, 30])
    first = _id_loaders(urls, counts, 2, 0, 4)
    trained = [i for loader in first for i in _ids(itertools.islice(iter(loader), 3))]
    second = _id_loaders(urls, counts, 1, 0, 5)
    second[0].resume(first[0].position(3))
    assert len(second[0]) == 3 + 46 // 5
    trained += _ids(itertools.islice(iter(second[0]), 4))  # Lightning's batches 3..6
    third = _id_loaders(urls, counts, 2, 2, 3)
    for loader in third:
        loader.resume(second[0].position(7))
    plan = third[0].dataset.plan()
    assert plan.total_samples == 70 - 24 - 20
    rest = [i for loader in third for i in _ids(loader)]
    seen = trained + rest
    assert len(set(seen)) == len(seen)
    assert len(set(range(70)) - set(seen)) == plan.dropped < 2 * 3


def test_resume_with_another_seed_keeps_the_epochs_order_for_its_rest(tmp_path: Path) -> None:
    """The rest of the epoch is the checkpoint's epoch (its shard order); the new seed shuffles
    it, and orders the epochs after."""
    urls, counts = _id_shards(tmp_path, [23, 17, 30])
    first = _id_loaders(urls, counts, 1, 0, 4)
    trained = _ids(itertools.islice(iter(first[0]), 5))
    resumed = _id_loaders(urls, counts, 1, 0, 4, seed=6)[0]
    resumed.resume(first[0].position(5))
    rest = _ids(resumed)
    assert not set(trained) & set(rest)
    assert len(set(rest)) == len(rest) == 48  # 50 left: 12 batches of 4, 2 dropped


def test_no_workers_and_one_worker_split_alike(tmp_path: Path) -> None:
    """0 workers reads as one in-process slot: resuming with 1 worker is the same split, and
    continues with exactly the batches the first run had next."""
    urls, counts = _id_shards(tmp_path, [23, 17, 30])
    first = _id_loaders(urls, counts, 1, 0, 4)[0]
    full = _ids(first)
    resumed = _id_loaders(urls, counts, 1, 1, 4)[0]
    resumed.resume(first.position(6))
    assert _ids(resumed) == full[24:]


def test_resume_over_other_shards_with_the_same_settings_trains_all_of_them(
    tmp_path: Path,
) -> None:
    """A checkpoint of other shards (a user's fine-tune on new data, or a mistake): its batches
    of the epoch say nothing of these shards, so the epoch goes over all of them after them.
    With the same split settings it used to skip that many batches of the new shards, past
    their end (`batch 6 of 5`)."""
    urls, counts = _id_shards(tmp_path, [23, 17, 30])
    first = _id_loaders(urls, counts, 1, 0, 4)[0]
    state = first.position(12)
    (tmp_path / "other").mkdir()
    other_urls, other_counts = _id_shards(tmp_path / "other", [10, 9])
    resumed = _id_loaders(other_urls, other_counts, 1, 0, 4)[0]
    resumed.resume(state)
    assert len(resumed) == 12 + 19 // 4  # Lightning counts on from batch 12
    assert sorted(_ids(resumed)) == sorted(_ids(_id_loaders(other_urls, other_counts, 1, 0, 4)[0]))
