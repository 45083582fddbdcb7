"""OutputShards: what ae-encode writes for each input shard, and its progress lines."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from ae.data.shards.tar_samples import iter_samples
from ae.job.encode_outputs import is_complete
from ae.training.encoding import OutputShards


def _batch(shard: int, keys: list[str], last: bool, damaged: bool = False) -> dict:
    return {"shard": shard, "keys": keys, "kept": [{} for _ in keys], "last": last,
            "damaged": damaged}  # fmt: skip


def test_a_damaged_input_leaves_no_output_and_progress_is_said(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An encode of many shards said nothing between its plan and its end (hours, for a large
    set): now each rank says, every PROGRESS_S at a shard's end, its shards and samples done
    of its share, the rate and the time left (rank 0's on the console). An input shard that
    could not be read to its end gets no output: a partial one would pass for complete."""
    urls = [f"/in/train-{i:06d}.tar" for i in range(3)]
    outs = [tmp_path / f"train-{i:06d}.tar" for i in range(3)]
    said: list[str] = []
    outputs = OutputShards(urls, outs, "latent.npy", "float16", planned=(3, 6), report=said.append)
    monkeypatch.setattr(OutputShards, "PROGRESS_S", 0.0)
    z = np.zeros((2, 4), np.float16)
    outputs.add(_batch(0, ["a", "b"], last=True), z)
    outputs.add(_batch(1, ["c", "d"], last=False), z)
    outputs.add(_batch(1, [], last=True, damaged=True), z[:0])
    assert outs[0].is_file() and not outs[1].exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # its temp went too
    assert (outputs.samples, outputs.shards, outputs.damaged) == (2, 1, [urls[1]])
    assert [s["__key__"] for s in iter_samples(str(outs[0]))] == ["a", "b"]
    assert len(said) == 2
    assert said[0].startswith("Encode progress of this rank: 1 of 3 shards, 2 of 6 samples, ")
    assert said[1].startswith("Encode progress of this rank: 2 of 3 shards, 4 of 6 samples, ")
    assert said[1].split("ETA ")[1].count(":") == 2  # h:mm:ss


@pytest.mark.parametrize(
    ("suffix", "magic"),
    [
        (".tar.gz", b"\x1f\x8b"),
        (".tgz", b"\x1f\x8b"),
        (".tar.bz2", b"BZh"),
        (".tar.xz", b"\xfd7zXZ"),
    ],
)
def test_the_output_of_a_compressed_input_is_compressed_alike(
    tmp_path: Path, suffix: str, magic: bytes
) -> None:
    """`train-000000.tar.gz` in, `train-000000.tar.gz` out: it was a plain tar under that name
    (ae read it; `tar xzf` and other readers fail on it); bzip2 and xz likewise."""
    out = tmp_path / f"train-000000{suffix}"
    outputs = OutputShards([f"/in/train-000000{suffix}"], [out], "latent.npy", "float32")
    outputs.add(_batch(0, ["a"], last=True), np.zeros((1, 2), np.float32))
    assert out.read_bytes()[: len(magic)] == magic
    assert [s["__key__"] for s in iter_samples(str(out))] == ["a"]
    assert is_complete(out)
