"""Feeds `ae.progress` from Lightning's loop: the phase a rank is in, and a beat per batch.

A batch handed to the training step is progress ("training step", with the optimizer step); from
the end of a step until the next batch arrives the rank is in "data loading" (the fetch, and
Lightning's per-step SIGTERM broadcast); validation batches beat in "validation". Each hook is two
attribute stores and two clock reads: nothing that would show in the step time.
"""

from __future__ import annotations

from typing import Any

import lightning as L

from ae.progress import progress


class ProgressBeats(L.Callback):
    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        progress.enter("setup")

    def on_train_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        progress.enter("data loading", epoch=trainer.current_epoch)

    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        progress.enter("training step", step=trainer.global_step)

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, idx: int
    ) -> None:
        progress.enter("data loading", step=trainer.global_step)

    def on_validation_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        progress.enter("validation")

    def on_validation_batch_end(self, *args: Any, **kwargs: Any) -> None:
        progress.beat()

    def on_validation_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        progress.enter("data loading")

    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        progress.enter("teardown")

    def on_exception(
        self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException
    ) -> None:
        progress.enter("teardown")
