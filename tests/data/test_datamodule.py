"""The data module's checks before any training: input shape, unusable data, rank agreement."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pytest
import torch

from ae.config import DataConfig
from ae.data import input_probe, rank_agreement
from ae.data.datamodule import ShardDataModule
from ae.data.input_probe import probe_decoder
from ae.data.rank_agreement import same_on_all_ranks
from ae.data.shards.errors import DataError
from ae.data.shards.writer import write_shard
from ae.forensics.step_times import StepTimes
from tests.support.forked_ranks import run_ranks
from tests.support.shards import vector_samples


def test_probe_skips_unreadable_shards_and_bad_samples(tmp_path: Path) -> None:
    junk = tmp_path / "junk.tar"
    junk.write_bytes(b"junk" * 500)
    bad_first = tmp_path / "bad.tar"
    write_shard(bad_first, [{"__key__": b"x", "npy": b"nope"}, *vector_samples(2, dim=6)])
    assert probe_decoder("train", [str(junk), str(bad_first)], DataConfig()).shape == (6,)


def test_every_shard_unreadable_is_a_clear_error(tmp_path: Path) -> None:
    urls = []
    for i in range(3):
        path = tmp_path / f"junk-{i}.tar"
        path.write_bytes(b"junk" * 500)
        urls.append(str(path))
    with pytest.raises(DataError, match=r"^train_shards: no readable sample in any of 3 shards"):
        probe_decoder("train", urls, DataConfig())


def test_building_the_data_module_reads_no_shard(tmp_path: Path, monkeypatch) -> None:
    """The constructor keeps the settings only: it builds over shards that do not exist, and
    neither probes a sample nor counts a shard; `setup` (or `probe`) is where they are read."""
    absent = [str(tmp_path / "absent-000000.tar")]
    dm = ShardDataModule(DataConfig(), absent, absent, seed=0)
    assert dm.train_set is None and dm.val_set is None
    with pytest.raises(DataError, match=r"^train_shards: no readable sample in any of 1 shards"):
        dm.probe()
    # over real shards: every sample read and every count goes through these two
    train = tmp_path / "t.tar"
    write_shard(train, vector_samples(8, dim=6))
    read, counted = [], []
    real_read, real_count = input_probe.iter_samples, rank_agreement.shared_counts
    monkeypatch.setattr(input_probe, "iter_samples", lambda *a: read.append(a) or real_read(*a))
    monkeypatch.setattr(
        rank_agreement, "shared_counts", lambda *a, **k: counted.append(a) or real_count(*a, **k)
    )
    cfg = DataConfig(num_workers=0, batch_size=4, count_cache="off")
    dm = ShardDataModule(cfg, [str(train)], [str(train)], seed=0)
    assert read == [] and counted == []
    dm.setup("fit")
    assert read and [split for split, *_ in counted] == ["train", "val"]
    assert dm.spec.shape == (6,) and len(dm.train_set) == 2


def test_val_shape_must_match_train(tmp_path: Path) -> None:
    train, val = tmp_path / "t.tar", tmp_path / "v.tar"
    write_shard(train, vector_samples(4, dim=6))
    write_shard(val, vector_samples(4, dim=5))
    shape = r"shape \(5,\), expected \(6,\)"
    with pytest.raises(DataError, match=rf"^val_shards: no readable sample .*{shape}"):
        ShardDataModule(DataConfig(), [str(train)], [str(val)], seed=0).setup("fit")


def test_first_samples_are_the_first_decodable_validation_samples(tmp_path: Path) -> None:
    """The real batch of the model check before training: bad samples skipped, as decoded."""
    train, val = tmp_path / "t.tar", tmp_path / "v.tar"
    write_shard(train, vector_samples(4, dim=6))
    good = vector_samples(3, dim=6, start=10)
    write_shard(val, [{"__key__": b"bad", "npy": b"not an array"}, *good])
    dm = ShardDataModule(DataConfig(), [str(train)], [str(val)], seed=0)
    batch = dm.first_samples(2)
    assert batch.shape == (2, 6) and batch.dtype == torch.float32
    assert torch.equal(
        batch, torch.from_numpy(np.stack([np.load(io.BytesIO(s["npy"])) for s in good[:2]]))
    )
    assert dm.first_samples(5).shape == (3, 6)  # all there are
    # validation held out of the train shards (no --val_shards): the train shards' samples
    held_out = ShardDataModule(DataConfig(), [str(train)], None, seed=0)
    assert held_out.first_samples(2).shape == (2, 6)


def test_the_heartbeat_reports_the_train_workers_the_rank_configured(tmp_path: Path) -> None:
    train = tmp_path / "t.tar"
    write_shard(train, vector_samples(16, dim=6))
    dm = ShardDataModule(
        DataConfig(num_workers=0, batch_size=4), [str(train)], [str(train)], seed=0
    )
    times = StepTimes()
    times.configure(7.0, dm.train_worker_rates)  # as ae.rank.train does, before setup
    assert times.recent_s == 7.0 and times.heartbeat()["data_workers"] == []
    dm.setup("fit")
    next(iter(dm.train_dataloader()))
    (worker,) = times.heartbeat()["data_workers"]
    assert worker["worker"] == 0 and worker["shard"] == str(train) and worker["batches"] == 1


def _agree(rank: int) -> str:
    cpu = torch.device("cpu")
    same = same_on_all_ranks([5, 7], cpu, [])
    differ = same_on_all_ranks([5, 7 + rank], cpu, [])  # rank 1 counted another shard size
    return f"{same} {differ}"


@pytest.mark.slow  # two processes
def test_every_rank_finds_out_when_counts_differ() -> None:
    assert run_ranks(_agree) == ["True False"] * 2
