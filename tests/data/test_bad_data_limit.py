"""Training on repeats is stopped, not hidden: images of several sizes without --image_size stop
before training, and an epoch whose bad-sample share passes --max_bad_fraction ends the run."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

import ae.data.stream.shard_stream as dataset
from ae.config import DataConfig, parse_config
from ae.data.bad_data_limit import BadDataBound, bad_data_problem
from ae.data.datamodule import ShardDataModule
from ae.data.shards.errors import DataError
from ae.data.shards.writer import npy_bytes, write_shard
from ae.training.step_boundary import StepBoundary
from ae.training.trainer import build_callbacks
from logging_cfg import RankContext
from tests.support.shards import image_samples, vector_samples


def test_images_of_several_sizes_without_image_size_stop_before_training(tmp_path: Path) -> None:
    """The first sample fits; the others, further in the shard and in other shards, do not."""
    write_shard(tmp_path / "a.tar", image_samples(1, size=8) + image_samples(3, size=12, start=1))
    write_shard(tmp_path / "b.tar", image_samples(2, size=10, start=4))
    urls = [str(tmp_path / "a.tar"), str(tmp_path / "b.tar")]
    with pytest.raises(DataError) as err:
        ShardDataModule(DataConfig(num_workers=0), urls, urls, seed=0).probe()
    text = err.value.render()
    assert text.startswith("train_shards: images of several sizes in the first 5 samples read")
    assert "12x12 (3), 8x8 (1), 10x10 (1)" in text and "--image_size=12" in text  # the median
    # With --image_size every size trains.
    ShardDataModule(DataConfig(num_workers=0, image_size=8), urls, urls, seed=0).probe()


def test_the_bound_message_names_the_fraction_every_ranks_count_and_the_flag() -> None:
    assert bad_data_problem([(0, 16), (1, 200)], 0.01, 0) is None
    problem = bad_data_problem([(6, 8), (5, 8)], 0.01, 3)
    assert problem is not None
    assert problem.startswith("train_shards: more than --max_bad_fraction=0.01 of epoch 3's")
    assert "(rank 0: 6 of 8, rank 1: 5 of 8)" in problem and "raise --max_bad_fraction" in problem


def test_an_epoch_with_too_many_bad_samples_ends_the_run_at_its_last_batch(
    tmp_path: Path, monkeypatch
) -> None:
    samples = vector_samples(12, 16)
    for i in (3, 5, 7):
        samples[i]["npy"] = npy_bytes(np.zeros(7, "float32"))  # wrong shape: replaced
    write_shard(tmp_path / "t.tar", samples)
    urls = [str(tmp_path / "t.tar")]
    cfg = DataConfig(num_workers=0, batch_size=4, shuffle_buffer=0)
    dm = ShardDataModule(cfg, urls, urls, seed=0)
    dm.setup("fit")
    monkeypatch.setattr(dataset, "get_worker_info", lambda: None)
    assert len(list(dm.train_set)) == 3  # 12 samples trained on: 3 of them repeats
    trainer = SimpleNamespace(
        datamodule=dm, world_size=1, current_epoch=0, num_training_batches=3, max_steps=-1,
        global_step=3, strategy=SimpleNamespace(root_device=torch.device("cpu")),
    )  # fmt: skip
    bound = BadDataBound(0.3)
    bound.on_train_batch_end(trainer, None, None, None, 2)  # 3 of 12: within 30%
    list(dm.train_set)  # the next epoch: 3 more replaced, counted apart from the first's 3
    bound.on_train_batch_end(trainer, None, None, None, 2)
    list(dm.train_set)
    bound.bound = 0.2
    bound.on_train_batch_end(trainer, None, None, None, 1)  # not a batch that checks
    with pytest.raises(DataError, match=r"--max_bad_fraction=0.2 .*\(rank 0: 3 of 12\)"):
        bound.on_train_batch_end(trainer, None, None, None, 2)  # the epoch's last batch


def test_the_bound_stops_the_run_before_the_last_steps_checkpoint_and_validation(
    tmp_path: Path,
) -> None:
    """It stopped the run only after the epoch trained and saved (at the epoch's end): now at the
    end of the epoch's last batch (above), in the callbacks before StepBoundary, which saves that
    step's checkpoint and validates."""
    cfg = parse_config([f"--output_dir={tmp_path / 'run'}"])
    ctx = RankContext(rank=0, local_rank=0, world_size=1)
    kinds = [type(c) for c in build_callbacks(cfg, ctx, "20260101_000000")]
    assert kinds.index(BadDataBound) < kinds.index(StepBoundary)
