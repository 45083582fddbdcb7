"""The epoch's mean training loss (`train/loss_epoch`) over the optimizer steps that were applied.

A step that the non-finite guard drops (`--on_nonfinite=skip`, and the bad step of `rollback`:
`ae.training.nonfinite`) stays out of the mean, on the rank that drops it: one NaN would make the
epoch's mean NaN, and a run that survived its bad step would look diverged. The losses stay on
the device (no host sync, no collective per step: bench/README.md, "The hot loop"); a step's
batches wait beside the sum until the next step starts (or the mean is taken), by which time the
guard, which decides before the optimizer step, has dropped them or not.
"""

from __future__ import annotations

import torch


class EpochLoss:
    """The built-in model's; the guard finds it on the module (`epoch_loss`) and calls
    `drop_step`. A plain object, not module state: nothing of it goes into a checkpoint."""

    __slots__ = ("count", "step", "step_count", "step_total", "total")

    def __init__(self) -> None:
        self.start()

    def start(self) -> None:
        """A new epoch (or a resumed one: what came before the resume is not in this process)."""
        self.total: torch.Tensor | None = None
        self.count = 0
        self.step = -1  # the global step the pending batches train from
        self.step_total: torch.Tensor | None = None
        self.step_count = 0

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

    def mean(self) -> torch.Tensor | None:
        """This rank's mean over the batches of the applied steps so far; None when there are
        none (every step of the epoch dropped)."""
        self._commit()
        return None if self.total is None else self.total / self.count

    def _commit(self) -> None:
        if self.step_total is None:
            return
        self.total = self.step_total if self.total is None else self.total + self.step_total
        self.count += self.step_count
        self.step_total, self.step_count = None, 0
