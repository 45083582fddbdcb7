"""`batch_members`: the samples a rank's batch held, replayed from the plan, are the ones the
stream really put in it (id samples: each row holds its own key's number)."""

from __future__ import annotations

from pathlib import Path

import pytest

from ae.data.stream.batch_members import batch_members
from tests.support.id_streams import make_stream, read_ids, write_id_shards


@pytest.mark.parametrize("columnar", [True, False])
def test_the_replayed_members_of_every_batch_are_the_batch(
    tmp_path: Path, monkeypatch, columnar: bool
) -> None:
    sizes = [13, 9, 17, 11]
    urls = write_id_shards(tmp_path, sizes)
    stream = make_stream(urls, sizes, rank=1, world_size=2, num_workers=2, shuffle=True,
                         shuffle_buffer=7, seed=3, epoch=1, columnar=columnar)  # fmt: skip
    per_worker = [read_ids(stream, w, monkeypatch) for w in range(2)]
    bs = stream.batch_size
    # the DataLoader takes batches round-robin: batch i is worker i % 2's (i // 2)-th
    n = len(stream)
    assert n >= 4
    for i in range(n):
        ids = per_worker[i % 2][(i // 2) * bs : (i // 2 + 1) * bs]
        members = batch_members(stream, i)
        assert sorted(int(m.key) for m in members) == sorted(ids)
        assert all(m.finite for m in members)
        assert all(m.url in urls for m in members)
