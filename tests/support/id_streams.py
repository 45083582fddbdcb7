"""ShardStreams over shards whose samples say who they are: sample i holds the value i."""

from __future__ import annotations

import io
from pathlib import Path
from types import SimpleNamespace

import numpy as np

import ae.data.stream.shard_stream as dataset
from ae.data.shards.writer import Sample, write_shard
from tests.support.shards import vector_decoder

DIM = 4


def npy_of(array: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, array)
    return buf.getvalue()


def id_sample(i: int, dim: int = DIM) -> Sample:
    """Every value of sample i is i: a batch row tells which sample it was."""
    return {"__key__": f"{i:08d}".encode(), "npy": npy_of(np.full(dim, i, np.float32))}


def write_id_shards(tmp_path: Path, sizes: list[int], dim: int = DIM) -> list[str]:
    urls, start = [], 0
    for k, n in enumerate(sizes):
        path = tmp_path / f"d-{k:06d}.tar"
        write_shard(path, [id_sample(i, dim) for i in range(start, start + n)])
        urls.append(str(path))
        start += n
    return urls


def make_stream(urls: list[str], counts: list[int], **kw) -> dataset.ShardStream:
    args = dict(
        split="train", urls=urls, counts=counts, decoder=vector_decoder(DIM), batch_size=4,
        rank=0, world_size=1, num_workers=1, shuffle=False,
    )  # fmt: skip
    return dataset.ShardStream(**{**args, **kw})


def read_ids(stream: dataset.ShardStream, worker: int, monkeypatch) -> list[int]:
    """Sample ids the stream yields as dataloader worker `worker`."""
    info = SimpleNamespace(id=worker, num_workers=stream.num_workers)
    monkeypatch.setattr(dataset, "get_worker_info", lambda: info)
    batches = list(stream)
    assert all(b.shape == (stream.batch_size, *stream.spec.shape) for b in batches)
    return [int(v) for b in batches for v in b[:, 0]]
