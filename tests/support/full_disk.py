"""Each kind of file `ae` writes, written by its real function onto a full filesystem.

`python -m tests.support.full_disk MNT` expects a small tmpfs (1 MB) mounted at `MNT/<kind>` for
each kind (tests/test_atomic_files.py mounts them in a private mount namespace). Per kind, a
first version is written, then a second that does not fit; it prints one JSON object: per kind,
the exception the write raised (`type errno`, or null), whether the first version is still what
the final name holds (or, with none, that no file is there), and the files in the folder.
"""

from __future__ import annotations

import errno
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from ae.data.planning.counts import shared_counts
from ae.data.shards.index import read_index, write_index
from ae.data.shards.writer import ShardWriter, write_shard
from ae.forensics.heartbeat import heartbeat_record, write_heartbeat
from ae.forensics.process_stats import RssReader
from ae.forensics.progress import Progress
from ae.training.checkpoint_files import CheckpointStore
from ae.training.checkpointing import AtomicCheckpointIO
from logging_cfg import RankContext
from tests.support.shards import vector_samples

MB = 2**20


def fill(folder: Path) -> None:
    """Take the free space of `folder`'s filesystem (another process's file)."""
    st = os.statvfs(folder)
    with open(folder / "filler", "wb") as f:
        os.posix_fallocate(f.fileno(), 0, st.f_bavail * st.f_frsize)


def attempt(write: Callable[[], object]) -> str | None:
    """What `write()` raised (`type errno`), or None."""
    try:
        write()
    except Exception as e:
        return f"{type(e).__name__} {errno.errorcode.get(getattr(e, 'errno', None) or 0)}"
    return None


def checkpoint(folder: Path) -> tuple[str | None, bool]:
    store = CheckpointStore(folder, keep=3)
    io = AtomicCheckpointIO()
    io.save_checkpoint({"global_step": 2, "w": torch.zeros(MB // 16)}, store.step_path(2))
    store.commit_step(store.step_path(2))
    big = {"global_step": 4, "w": torch.zeros(MB // 2)}  # 2 MB
    raised = attempt(lambda: io.save_checkpoint(big, store.step_path(4)))
    last = torch.load(store.last, weights_only=False)
    return raised, last["global_step"] == 2 and os.path.samefile(store.last, store.step_path(2))


def index(folder: Path) -> tuple[str | None, bool]:
    shard = folder / "a.tar"
    write_shard(shard, vector_samples(3, 8))
    # the offsets of a million samples: a sidecar of ~8 MB
    raised = attempt(lambda: write_index(shard, 10**6, list(range(0, 512 * 10**6, 512))))
    kept = read_index(str(shard), with_offsets=True)
    return raised, kept is not None and kept.samples == 3 and len(kept.offsets or []) == 3


def counts(folder: Path) -> tuple[str | None, bool]:
    """The cache is written after a count: a full disk costs the cache, not the count."""
    shards = folder.parent / "shards"  # on the test's own disk, beside the mounts
    urls = [str(shards / f"s{i}.tar") for i in range(3)]
    for url in urls:
        write_shard(Path(url), vector_samples(2, 8))
    fill(folder)
    got: list[int] = []
    raised = attempt(lambda: got.extend(shared_counts("train", urls, folder / "cache").counts))
    return raised, got == [2, 2, 2]


def shard(folder: Path) -> tuple[str | None, bool]:
    path = folder / "train-000000.tar"
    write_shard(path, vector_samples(2, 8))
    old = path.read_bytes()
    raised = attempt(lambda: write_shard(path, vector_samples(3, MB // 8)))  # 3 x 512 KB
    return raised, path.read_bytes() == old and read_index(str(path)) is not None


def shard_closing(folder: Path) -> tuple[str | None, bool]:
    """The samples fit; the end of the archive, written by `close()`, does not."""
    path = folder / "train-000000.tar"
    writer = ShardWriter(path)
    writer.add(vector_samples(1, 8)[0])
    fill(folder)
    return attempt(writer.close), not path.exists()


def heartbeat(folder: Path) -> tuple[str | None, bool]:
    path = folder / "heartbeat_rank0_TS.json"
    progress = Progress()
    progress.enter("training step", step=7)
    write_heartbeat(path, heartbeat_record(RankContext(), progress, RssReader(), stalled=False))
    fill(folder)
    progress.enter("training step", step=8)
    record = heartbeat_record(RankContext(), progress, RssReader(), stalled=False)
    raised = attempt(lambda: write_heartbeat(path, record))
    return raised, json.loads(path.read_text())["step"] == 7


KINDS: dict[str, Callable[[Path], tuple[str | None, bool]]] = {
    "checkpoint": checkpoint,
    "index": index,
    "counts": counts,
    "shard": shard,
    "shard_closing": shard_closing,
    "heartbeat": heartbeat,
}


def run(kind: str, folder: Path) -> dict[str, Any]:
    raised, kept = KINDS[kind](folder)
    files = sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file())
    return {"raised": raised, "kept": kept, "files": [f for f in files if f != "filler"]}


if __name__ == "__main__":
    mnt = Path(sys.argv[1])
    print(json.dumps({kind: run(kind, mnt / kind) for kind in KINDS}))
