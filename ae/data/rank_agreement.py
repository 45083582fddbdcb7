"""Every rank plans from the same counts: each counts a share of the shards (one all-gather,
`ae.data.planning.counts`), then one all-reduce of a digest checks that all ranks hold the same
list. Different counts would give different plans, and a hang at the first collective."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import lightning as L
import torch
import torch.distributed as dist

from ae.data.planning.counts import shared_counts
from ae.data.shards.errors import DataError


def same_on_all_ranks(values: list[int], device: torch.device, keep: list[torch.Tensor]) -> bool:
    """One all-reduce: the MAX of (d, -d) over ranks is (max d, -min d), equal iff every rank's
    digest d of `values` is the same. The reduced tensor is appended to `keep`, which the caller
    holds until the run ends: were the tensor's last reference dropped while gloo's worker thread
    still held the op, that thread would take the GIL to free it, and a dataloader worker forked
    at that moment can hang in fork (seen once here: gloo, CPython 3.11)."""
    digest = int.from_bytes(hashlib.sha256(json.dumps(values).encode()).digest()[:7])
    both = torch.tensor([digest, -digest], dtype=torch.int64, device=device)
    dist.all_reduce(both, op=dist.ReduceOp.MAX)
    keep.append(both)
    return int(both[0]) == -int(both[1])


def agreed_counts(
    split: str,
    urls: list[str],
    trainer: L.Trainer | None,
    *,
    cache_dir: Path | None,
    write_sidecars: bool,
    keep: list[torch.Tensor],
) -> list[int]:
    """The samples of each shard of `urls`, counted by all ranks (a share each, one
    all-gather), then checked to be the same on every rank. `keep`: see `same_on_all_ranks`."""
    distributed = trainer is not None and trainer.world_size > 1

    def gather(mine: dict) -> list[dict]:
        if not distributed:
            return [mine]
        parts: list[dict] = [{}] * trainer.world_size
        dist.all_gather_object(parts, mine)
        return parts

    counts = shared_counts(
        split,
        urls,
        cache_dir,
        rank=trainer.global_rank if trainer else 0,
        world_size=trainer.world_size if trainer else 1,
        gather=gather,
        write_sidecars=write_sidecars,
    )
    if counts.total == 0:
        raise DataError(f"{split}_shards: no readable sample in {len(urls)} shards")
    if distributed and not same_on_all_ranks(counts.counts, trainer.strategy.root_device, keep):
        raise DataError(
            f"{split}_shards: ranks counted different samples per shard (do all nodes see"
            " the same files?); see the `Shard counts` line in each rank's log"
        )
    return counts.counts
