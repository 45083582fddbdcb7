"""Train workers hand batches over in reused shared-memory buffers: the same batches as with a
new segment each, none overwritten while the rank holds it, buffers reused once it lets go."""

from __future__ import annotations

import os

import pytest
import torch

from ae.data.shards.spec import resolve_shards
from ae.data.shards.tar_header_count import count_samples
from ae.data.stream.batch_buffers import SLOTS
from ae.data.stream.resume import ResumableLoader
from ae.data.stream.shard_stream import ShardStream
from tests.support.shards import vector_decoder, write_test_shards


def _loader(spec: str, buffers: bool = True) -> ResumableLoader:
    urls, _ = resolve_shards(spec, spec)
    stream = ShardStream(
        split="train", urls=urls, counts=[count_samples(u) for u in urls],
        decoder=vector_decoder(16), batch_size=4, rank=0, world_size=1,
        num_workers=2, shuffle=True, shuffle_buffer=16, seed=3,
    )  # fmt: skip
    loader = ResumableLoader(stream, batch_size=None, num_workers=2, persistent_workers=True)
    if not buffers:
        stream.released = None  # a new segment for every batch, as torch does
    return loader


def _epochs(loader: ResumableLoader, epochs: int, keep: bool) -> tuple[list, list[int]]:
    """Every batch of `epochs` epochs (the batches themselves if `keep`, else copies), and the
    shared-memory segment each arrived in."""
    batches, segments = [], []
    for epoch in range(epochs):
        loader.dataset.epoch = epoch
        for batch in loader:
            fd, _ = batch.untyped_storage()._share_fd_cpu_()
            segments.append(os.fstat(fd).st_ino)
            batches.append(batch if keep else batch.clone())
    return batches, segments


@pytest.fixture(scope="module")
def spec(tmp_path_factory: pytest.TempPathFactory) -> str:
    return write_test_shards(tmp_path_factory.mktemp("buffers"), [120, 90], "npy", "train", 16)


@pytest.fixture(scope="module")
def expected(spec: str) -> list[torch.Tensor]:
    return _epochs(_loader(spec, buffers=False), 2, keep=False)[0]


def test_batches_the_rank_holds_are_never_overwritten(spec: str, expected: list) -> None:
    held, segments = _epochs(_loader(spec), 2, keep=True)  # the rank lets go of none
    assert len(held) == len(expected) == 2 * 52
    assert all(torch.equal(a, b) for a, b in zip(held, expected, strict=True))
    assert len(set(segments)) == len(held)  # each its own segment: nothing was reused


def test_buffers_are_reused_once_the_rank_lets_go(spec: str, expected: list) -> None:
    seen, segments = _epochs(_loader(spec), 2, keep=False)  # each batch dropped after its copy
    assert all(torch.equal(a, b) for a, b in zip(seen, expected, strict=True))
    # per epoch 2 workers x SLOTS buffers, and a few new segments while the loop still held the
    # batch in a buffer's turn; without reuse: one segment per batch (52 an epoch)
    for epoch in (segments[:52], segments[52:]):
        assert len(set(epoch)) <= 2 * SLOTS + 6


def test_without_workers_batches_are_not_tagged(spec: str) -> None:
    urls, _ = resolve_shards(spec, spec)
    stream = ShardStream(
        split="train", urls=urls, counts=[count_samples(u) for u in urls],
        decoder=vector_decoder(16), batch_size=4, rank=0, world_size=1, num_workers=0,
    )  # fmt: skip
    loader = ResumableLoader(stream, batch_size=None, num_workers=0)
    assert stream.released is None
    assert all(isinstance(b, torch.Tensor) for b in loader)


def test_the_preflights_shared_memory_margin_covers_the_buffers() -> None:
    from ae.config import PREFETCH_FACTOR
    from ae.job.preflight import SHM_MARGIN

    assert SLOTS <= PREFETCH_FACTOR * SHM_MARGIN
