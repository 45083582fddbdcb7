"""--shard_split=resampled in one process: equal batches per rank for any shard set, no count."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

import ae.data.shards.index as index
from ae.data.shards import tar_header_count
from tests.support.id_streams import make_stream as _stream
from tests.support.id_streams import read_ids as _read
from tests.support.id_streams import write_id_shards as _write


@pytest.mark.parametrize("seed", range(4))
def test_every_rank_and_worker_gets_its_quota_for_any_shard_set(
    tmp_path: Path, monkeypatch, seed: int
) -> None:
    rng = random.Random(seed)
    sizes = [rng.randint(1, 30) for _ in range(rng.randint(1, 7))]
    urls = _write(tmp_path, sizes)
    for url in urls[::2]:  # some shards without a sidecar: nothing may count them
        Path(url + ".idx").unlink()

    def no_count(*args: object) -> None:
        raise AssertionError("resampled mode counted a shard")

    monkeypatch.setattr(tar_header_count, "walk_headers", no_count)
    monkeypatch.setattr(index, "read_index", no_count)
    world, workers, epoch_samples = rng.randint(1, 4), rng.randint(1, 3), rng.randint(40, 300)
    batches = epoch_samples // (world * 4)
    seen: set[int] = set()
    for rank in range(world):
        stream = _stream(
            urls, [], rank=rank, world_size=world, num_workers=workers, mode="resampled",
            epoch_samples=epoch_samples, shuffle=True, seed=seed,
        )  # fmt: skip
        plan = stream.plan()
        assert len(stream) == plan.batches_per_rank == batches
        ids = [i for w in range(workers) for i in _read(stream, w, monkeypatch)]
        assert len(ids) == batches * 4  # the same steps on every rank
        seen.update(ids)
    assert seen <= set(range(sum(sizes)))  # real samples of the shards, drawn with replacement
    again = _stream(
        urls, [], rank=0, world_size=world, num_workers=workers, mode="resampled",
        epoch_samples=epoch_samples, shuffle=True, seed=seed,
    )  # fmt: skip
    first = _read(again, 0, monkeypatch)
    assert first == _read(again, 0, monkeypatch)  # seeded: the same draws again
