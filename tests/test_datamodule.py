"""The data module's checks before any training: input shape probe and unusable data."""

from __future__ import annotations

from pathlib import Path

import pytest

from ae.config import Config
from ae.datamodule import DataError, ShardDataModule, probe_input_spec
from ae.shard_writer import write_shard
from tests.conftest import vector_samples


def test_probe_skips_unreadable_shards_and_bad_samples(tmp_path: Path) -> None:
    junk = tmp_path / "junk.tar"
    junk.write_bytes(b"junk" * 500)
    bad_first = tmp_path / "bad.tar"
    write_shard(bad_first, [{"__key__": b"x", "npy": b"nope"}, *vector_samples(2, dim=6)])
    assert probe_input_spec("train", [str(junk), str(bad_first)]).shape == (6,)


def test_every_shard_unreadable_is_a_clear_error(tmp_path: Path) -> None:
    urls = []
    for i in range(3):
        path = tmp_path / f"junk-{i}.tar"
        path.write_bytes(b"junk" * 500)
        urls.append(str(path))
    with pytest.raises(DataError, match=r"^train_shards: no readable sample in any of 3 shards"):
        probe_input_spec("train", urls)


def test_val_shape_must_match_train(tmp_path: Path) -> None:
    train, val = tmp_path / "t.tar", tmp_path / "v.tar"
    write_shard(train, vector_samples(4, dim=6))
    write_shard(val, vector_samples(4, dim=5))
    with pytest.raises(DataError, match=r"val_shards: samples have shape \(5,\), train_shards"):
        ShardDataModule(Config(), [str(train)], [str(val)])
