"""The epoch's mean training loss (`train/loss_epoch`) over the optimizer steps that were applied.

A step that the non-finite guard drops (`--on_nonfinite=skip`, and the bad step of `rollback`:
`ae.training.nonfinite`) stays out of the mean, on the rank that drops it: one NaN would make the
epoch's mean NaN, and a run that survived its bad step would look diverged. The losses stay on
the device (no host sync, no collective per step: docs/BENCHMARKS.md, "The hot loop"); a step's
batches wait beside the sum until the next step starts (or the mean is taken), by which time the
guard, which decides before the optimizer step, has dropped them or not.

A resumed epoch (`--resume_from_checkpoint`, a restart) covers its steps before the resume too:
every step checkpoint carries the all-ranks sum and count of the epoch so far (`state_dict`,
reduced at the save, which every rank takes at the same step: a collective on the saves' cadence,
not per step), and the resumed run counts them once, on one rank, whatever its number of ranks.
A rollback reloads weights and optimizer state only: the sum it goes on with is this process's.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

CHECKPOINT_KEY = "ae_epoch_loss"  # {"total": float, "count": int}: plain data, the safe loader's


class EpochLoss:
    """The built-in model's; the guard finds it on the module (`epoch_loss`) and calls
    `drop_step`. A plain object, not module state (a rollback's `load_state_dict` leaves it):
    the module puts its `state_dict` into a checkpoint under `CHECKPOINT_KEY`."""

    __slots__ = ("before", "before_total", "count", "step", "step_count", "step_total", "total")

    def __init__(self) -> None:
        self.start()

    def start(self) -> None:
        """A new epoch: nothing of it trained yet."""
        self.total: torch.Tensor | None = None
        self.count = 0
        self.step = -1  # the global step the pending batches train from
        self.step_total: torch.Tensor | None = None
        self.step_count = 0
        # The batches of the epoch before the resume, all ranks': their count on every rank (so
        # every rank decides alike whether there is a mean), their sum on the one that counts it.
        self.before = 0
        self.before_total: float | None = None

    def add(self, loss: torch.Tensor, step: int) -> None:
        """A batch's loss; `step`: the global step it trains from (the batches of one optimizer
        step share it under gradient accumulation)."""
        if step != self.step:
            self._commit()
            self.step = step
        loss = loss.detach()
        self.step_total = loss if self.step_total is None else self.step_total + loss
        self.step_count += 1

    def drop_step(self) -> None:
        """The step under way is not applied: its batches stay out of the mean."""
        self.step_total, self.step_count = None, 0

    def share(self, device: torch.device) -> tuple[torch.Tensor, int] | None:
        """This rank's part of the all-ranks mean: (its mean, its batch count), to be averaged
        over the ranks weighted by the count (Lightning's `self.log(..., batch_size=count,
        sync_dist=True)`); None, on every rank alike, when no rank has a batch (every step of
        the epoch dropped). A rank with nothing of its own still takes part: (0, 0)."""
        self._commit()
        if self.count + self.before == 0:
            return None
        total, count = self.total, self.count
        if self.before_total is not None:
            count += self.before
            before = torch.tensor(self.before_total, device=device)  # once per epoch
            total = before if total is None else total + before
        if total is None or count == 0:
            return torch.zeros((), device=device), 0
        return total / count, count

    def state_dict(
        self, step: int, reduce_sum: Callable[[torch.Tensor], torch.Tensor], device: torch.device
    ) -> dict[str, Any]:
        """The epoch so far, all ranks': `{"total", "count"}` as plain numbers. At a save after
        optimizer step `step` (`trainer.global_step`), on every rank: `reduce_sum` sums a tensor
        over the ranks (a collective). The pending batches count once their step is applied
        (the guard has decided by then); under accumulation a step still under way does not."""
        if step > self.step:
            self._commit()
        mine = [0.0 if self.total is None else self.total, float(self.count)]
        if self.before_total is not None:
            mine = [mine[0] + self.before_total, mine[1] + self.before]
        both = torch.stack([torch.as_tensor(x, dtype=torch.float32, device=device) for x in mine])
        total, count = reduce_sum(both).tolist()  # one host sync, at the save
        return {"total": total, "count": round(count)}

    def load_state_dict(self, state: object, counted_here: bool) -> None:
        """On resume: the epoch before the checkpoint (`state_dict`'s), counted on this rank
        when `counted_here` (on exactly one rank). A checkpoint without it (older code, or one
        taken by a user's module) leaves the mean to the steps after the resume."""
        self.start()
        if not isinstance(state, dict) or "count" not in state or "total" not in state:
            return
        self.before = int(state["count"])
        self.before_total = float(state["total"]) if counted_here else None

    def _commit(self) -> None:
        if self.step_total is None:
            return
        self.total = self.step_total if self.total is None else self.total + self.step_total
        self.count += self.step_count
        self.step_total, self.step_count = None, 0
