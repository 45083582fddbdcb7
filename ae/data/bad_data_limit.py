"""The bound on bad data: a run whose ranks replace more than `--max_bad_fraction` of an epoch's
samples (with repeats of good ones) stops at that epoch's last batch, before that step's
checkpoint and validation, instead of training on repeats."""

from __future__ import annotations

from typing import Any

import lightning as L
import torch
import torch.distributed as dist

from ae.data.datamodule import ShardDataModule
from ae.data.shards.errors import DataError


def bad_data_problem(
    per_rank: list[tuple[int, int]], bound: float, epoch: int, split: str = "train"
) -> str | None:
    """The message when a rank's share of bad (replaced) samples in an epoch is above `bound`:
    `per_rank` holds (replaced, planned) for each rank; None when every rank is within it."""
    if all(bad <= bound * planned for bad, planned in per_rank):
        return None
    counts = ", ".join(f"rank {r}: {b} of {p}" for r, (b, p) in enumerate(per_rank))
    return (
        f"{split}_shards: more than --max_bad_fraction={bound:g} of epoch {epoch}'s samples were "
        f"bad and replaced by repeats of good ones ({counts}); the bad samples are named in "
        f'the rank logs (grep "Bad sample" debug_rank*.log; ae-shards inspect lists them). Fix '
        "the data, pass --image_size for images of several sizes, or raise --max_bad_fraction"
    )


class BadDataBound(L.Callback):
    """Stops the run (DataError, exit 2) when any rank replaced more than `--max_bad_fraction` of
    its samples of the epoch (it would be training on repeats), at the end of the epoch's last
    batch: the stream replaces bad samples at the end of its share, so the count is whole only
    then. `StepBoundary`, after this in the callbacks, has not yet saved that step's checkpoint
    or validated. Every rank's counts are gathered (one all-gather), so every rank stops alike,
    with all the counts."""

    def __init__(self, bound: float) -> None:
        self.bound = bound
        self.seen = 0  # replaced samples counted up to the previous epoch's end
        self.counts: list[torch.Tensor] = []  # the all-gather's buffers, reused every epoch

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, idx: int
    ) -> None:
        if idx + 1 < trainer.num_training_batches:  # not the epoch's last batch
            return
        dm = trainer.datamodule
        if not isinstance(dm, ShardDataModule) or dm.train_set is None:
            return
        replaced = dm.train_set.errors.totals()[2]  # counted before their batch is yielded
        planned = dm.train_set.plan().samples_per_rank
        if not self.counts:
            # Kept until the run ends (`same_on_all_ranks` says why), so allocated once.
            device = trainer.strategy.root_device
            self.counts = [torch.zeros(2, dtype=torch.int64, device=device)
                           for _ in range(trainer.world_size + 1)]  # fmt: skip
            dm.collective_inputs += self.counts
        mine, parts = self.counts[0], self.counts[1:]
        mine.copy_(torch.tensor([replaced - self.seen, planned]))
        self.seen = replaced
        if trainer.world_size > 1:
            dist.all_gather(parts, mine)
        else:
            parts[0].copy_(mine)
        per_rank = [(int(p[0]), int(p[1])) for p in parts]
        if (problem := bad_data_problem(per_rank, self.bound, trainer.current_epoch)) is not None:
            raise DataError(problem)
