"""Mid-epoch resume of the train stream: exactly the batches an uninterrupted epoch had left."""

from __future__ import annotations

import pytest
import torch

from ae.data_resume import ResumableLoader
from ae.dataset import ShardStream, resumed_slot, worker_skip
from ae.decode import InputSpec
from ae.shard_spec import resolve_shards
from ae.tar_samples import count_samples


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
        spec=InputSpec("vector", (16,)), batch_size=4, rank=1, world_size=2,
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
