"""WholeShards: every sample of a rank's shards exactly once, in whole-shard batches."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

import pytest
from torch.utils.data import DataLoader

from ae.data.shards.writer import write_shard
from ae.data.stream.encode_stream import WholeShards
from tests.support.shards import vector_decoder, vector_samples


def _shards(tmp_path: Path, sizes: list[int]) -> list[str]:
    urls, start = [], 0
    for i, n in enumerate(sizes):
        samples = vector_samples(n, 4, start)
        for s in samples:
            s["cls"] = s["__key__"][-1:]
        url = tmp_path / f"in-{i:06d}.tar"
        write_shard(url, samples)
        urls.append(str(url))
        start += n
    return urls


@pytest.mark.parametrize("workers", [0, 2])
def test_each_sample_once_with_one_last_batch_per_shard(tmp_path: Path, workers: int) -> None:
    urls = _shards(tmp_path, [7, 0, 5, 3])
    ds = WholeShards(urls, [0, 1, 3], vector_decoder(4), 3, workers, frozenset({"cls"}))
    keys: dict[int, list[str]] = defaultdict(list)
    lasts: list[int] = []
    for item in DataLoader(ds, batch_size=None, num_workers=workers):
        assert lasts.count(item["shard"]) == 0  # nothing after a shard's last batch
        assert len(item["keys"]) == len(item["inputs"]) == len(item["kept"]) <= 3
        pairs = zip(item["kept"], item["keys"], strict=True)
        assert all(kept["cls"] == key[-1:].encode() for kept, key in pairs)
        keys[item["shard"]] += item["keys"]
        if item["last"]:
            lasts.append(item["shard"])
    assert sorted(lasts) == [0, 1, 3]  # the empty shard too: its output gets closed
    assert keys[0] == [f"{i:08d}" for i in range(7)]  # in order, each once
    assert keys[1] == [] and keys[3] == [f"{i:08d}" for i in range(12, 15)]


def test_bad_sample_and_truncated_shard_are_logged_and_skipped(
    tmp_path: Path, records: list[tuple[str, str]]
) -> None:
    urls = _shards(tmp_path, [4, 6])
    samples = vector_samples(3, 4, 100)
    samples[1]["npy"] = b"not an array"
    write_shard(Path(urls[0]), samples)
    data = Path(urls[1]).read_bytes()
    Path(urls[1]).write_bytes(data[: len(data) // 2])  # truncated mid-shard
    ds = WholeShards(urls, [0, 1], vector_decoder(4), 8, 0, planned={0: 3, 1: 6})
    items = list(ds)
    assert [i["keys"] for i in items if i["shard"] == 0] == [["00000100", "00000102"]]
    truncated = [k for i in items if i["shard"] == 1 for k in i["keys"]]
    assert 0 < len(truncated) < 6 and items[-1]["last"]
    # The truncated shard's last batch says so (its output is dropped), and its ERROR line
    # counts the samples of the plan it lost (it said "0 of <read> planned samples lost")
    assert items[-1]["damaged"] and not any(i["damaged"] for i in items if i["shard"] == 0)
    (line,) = [m for _, m in records if m.startswith("Bad shard")]
    assert f"; {6 - len(truncated)} of 6 planned samples lost)" in line
    bad_samples, bad_shards, _ = ds.errors.totals()
    assert (bad_samples, bad_shards) == (1, 1)
