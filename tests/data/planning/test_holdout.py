"""Validation held out of the train shards (no --val_shards): deterministic, disjoint from the
train split, at least one batch per rank, by shard with many shards and by sample with few."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
from loguru import logger

import ae.data.stream.shard_stream as dataset
from ae.config import DataConfig
from ae.data.datamodule import ShardDataModule
from ae.data.planning.holdout import Holdout, hold_out
from ae.data.shards import demo
from ae.data.shards.errors import DataError
from ae.log_lines import VALIDATION_HELD_OUT, VALIDATION_OFF
from tests.support.id_streams import write_id_shards


def _covered(parts: tuple) -> list[tuple[int, int]]:
    return [(p.shard, i) for p in parts for i in range(p.start, p.stop)]


@pytest.mark.parametrize(
    ("counts", "fraction", "least", "by"),
    [
        ([1000], 0.01, 64, "sample"),  # one shard: stretches of it, one batch per rank at least
        ([10, 10, 10, 5], 0.01, 8, "sample"),
        ([1000] * 250, 0.01, 64, "shard"),  # many shards: a few whole ones, spread
        ([100, 3] * 60, 0.01, 40, "shard"),  # uneven shards: more of them until the share fits
        ([100] * 120, 0.01, 5000, "sample"),  # one batch per rank is more than whole shards give
    ],
)
def test_the_split_is_disjoint_complete_and_large_enough(
    counts: list[int], fraction: float, least: int, by: str
) -> None:
    split = hold_out(counts, fraction, least)
    assert split == hold_out(counts, fraction, least)  # deterministic: no seed, no epoch
    assert split.by == by
    val, train = _covered(split.val), _covered(split.train)
    assert not set(val) & set(train)
    assert sorted(val + train) == [(s, i) for s, n in enumerate(counts) for i in range(n)]
    total = sum(counts)
    assert Holdout.size(split.val) >= max(least, fraction * total)
    if by == "sample":
        assert Holdout.size(split.val) == max(least, -(-total // 100))
    else:
        assert all(p.start == 0 and p.stop == counts[p.shard] for p in split.val)
        assert len({p.shard for p in split.val}) <= 2 * -(-len(counts) // 100)
        shards = sorted(p.shard for p in split.val)
        assert shards[0] > 0 and shards[-1] < len(counts) - 1  # spread, not the list's end


def _ids(dm: ShardDataModule, loader, monkeypatch) -> list[int]:
    monkeypatch.setattr(dataset, "get_worker_info", lambda: SimpleNamespace(id=0, num_workers=1))
    return [int(v) for batch in loader.dataset for v in batch[:, 0]]


@pytest.fixture
def main_lines() -> list[str]:
    lines: list[str] = []
    sink = logger.add(lambda m: lines.append(m.record["message"]), filter=lambda r: r["extra"])
    yield lines
    logger.remove(sink)


@pytest.mark.parametrize(("sizes", "by", "val"), [([20], "sample", 4), ([4] * 12, "shard", 8)])
def test_a_run_without_val_shards_validates_on_held_out_train_samples(
    tmp_path: Path, monkeypatch, main_lines: list[str], sizes: list[int], by: str, val: int
) -> None:
    urls = write_id_shards(tmp_path, sizes)
    cfg = DataConfig(num_workers=0, batch_size=4, val_fraction=0.1, shuffle_buffer=0)
    dm = ShardDataModule(cfg, urls, None, seed=0)
    dm.setup("fit")
    train, held = (
        _ids(dm, dm.train_dataloader(), monkeypatch),
        _ids(dm, dm.val_dataloader(), monkeypatch),
    )
    assert len(held) == val and not set(train) & set(held)
    assert sorted(train + held) == list(range(sum(sizes)))  # every sample in one split
    (line,) = [m for m in main_lines if m.startswith("Validation:")]
    fields = VALIDATION_HELD_OUT.parse(line)
    assert fields is not None and fields["by"] == by and int(fields["val"]) == val
    assert int(fields["train"]) == len(train) and "--val_shards=none" in line


def _splits(dm: ShardDataModule, monkeypatch) -> tuple[list[int], list[int]]:
    dm.setup("fit")
    return (
        _ids(dm, dm.train_dataloader(), monkeypatch),
        _ids(dm, dm.val_dataloader(), monkeypatch),
    )


@pytest.mark.parametrize("batch", [2, 8])  # a smaller batch per rank (or fewer ranks), a larger
def test_a_resumed_run_holds_out_what_the_run_it_resumes_held_out(
    tmp_path: Path, monkeypatch, main_lines: list[str], batch: int
) -> None:
    urls = write_id_shards(tmp_path, [20, 20])

    def module(batch_size: int) -> ShardDataModule:
        cfg = DataConfig(num_workers=0, batch_size=batch_size, shuffle_buffer=0)
        return ShardDataModule(cfg, urls, None, seed=0)

    first = module(4)
    train, held = _splits(first, monkeypatch)
    assert len(held) == 4  # one batch per rank (1% of 40 is less)
    state = first.state_dict()
    main_lines.clear()
    resumed = module(batch)
    resumed.resume_plan(state)
    train_now, held_now = _splits(resumed, monkeypatch)
    assert set(held_now) == set(held) and set(train_now) <= set(train)
    assert resumed.state_dict()["holdout"] == state["holdout"]  # the first run's, kept
    (line,) = [m for m in main_lines if m.startswith("Validation:")]
    fields = VALIDATION_HELD_OUT.parse(line)
    assert fields is not None and int(fields["val"]) == 4 and int(fields["train"]) == 36
    assert "(as in the run resumed: --val_fraction=0.01, at least 4 samples)" in line
    if batch > len(held):  # its batch filled by repeating held-out samples, never train ones
        assert sorted(set(held_now)) == sorted(held) and len(held_now) == batch
        assert ", 4 of them repeated to fill one batch per rank;" in line
    else:
        assert sorted(held_now) == sorted(held) and "repeated" not in line


def test_a_checkpoint_without_the_record_holds_out_as_a_fresh_run(
    tmp_path: Path, monkeypatch
) -> None:
    """Checkpoints from before the record: the resumed run's own batch per rank, as before."""
    urls = write_id_shards(tmp_path, [40])
    dm = ShardDataModule(DataConfig(num_workers=0, batch_size=2), urls, None, seed=0)
    dm.resume_plan({"train": {"epoch": 1, "batches": 0}})
    _, held = _splits(dm, monkeypatch)
    assert len(held) == 2 and dm.state_dict()["holdout"] == {"least": 2, "unit": "samples"}


def test_too_few_samples_to_hold_out_a_batch_per_rank_names_the_flags(tmp_path: Path) -> None:
    urls = write_id_shards(tmp_path, [7])
    dm = ShardDataModule(DataConfig(num_workers=0, batch_size=4), urls, None, seed=0)
    with pytest.raises(DataError, match=r"train_shards: 7 samples cannot hold out .*--val_shards"):
        dm.setup("fit")
    with pytest.raises(DataError, match=r"\(one batch of 4 per rank on 1 rank\)"):  # not 1 ranks
        dm.setup("fit")


def test_val_shards_none_turns_validation_off_once(tmp_path: Path, main_lines: list[str]) -> None:
    urls = write_id_shards(tmp_path, [8])
    cfg = DataConfig(num_workers=0, batch_size=4, val_shards="none")
    dm = ShardDataModule(cfg, urls, None, seed=0)
    dm.setup("fit")
    assert dm.val_set is None and dm.val_dataloader() == []
    assert len(dm.train_set.plan().counts) == 1 and dm.train_set.plan().total_samples == 8
    assert main_lines.count(VALIDATION_OFF) == 1 and "best.ckpt" in VALIDATION_OFF


def test_the_demo_val_split_comes_only_with_the_demo_train_split(monkeypatch) -> None:
    monkeypatch.setattr(demo, "demo_shard_specs", lambda: ("demo-train", "demo-val"))
    assert demo.with_demo_defaults("mine/*.tar", None) == ("mine/*.tar", None)
    assert demo.with_demo_defaults("mine/*.tar", "none") == ("mine/*.tar", "none")
    assert demo.with_demo_defaults(None, None) == ("demo-train", "demo-val")


def test_resampled_training_holds_out_whole_shards(tmp_path: Path, main_lines: list[str]) -> None:
    """Resampled training draws whole shards (uncounted), so whole shards are held out."""
    urls = write_id_shards(tmp_path, [8, 8, 8, 8])
    cfg = DataConfig(num_workers=0, batch_size=4, shard_split="resampled", epoch_samples=16)
    dm = ShardDataModule(cfg, urls, None, seed=0)
    dm.resume_plan({"holdout": {"least": 8, "unit": "samples"}})  # a counted run's: not shards
    dm.setup("fit")
    assert dm.val_set.urls == urls[3:] and dm.train_set.urls == urls[:3]
    (line,) = [m for m in main_lines if m.startswith("Validation:")]
    assert line.startswith("Validation: 1 of the 4 shards of train_shards held out by shard")
    assert "at least one shard)" in line and "resumed" not in line
