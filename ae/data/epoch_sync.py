"""The callback that keeps the data module's epoch and position in step with the trainer's: the
shuffle and plan of each epoch and the batches trained in it (what a checkpoint records). What a
resume tells Lightning is `ae.training.position`'s."""

from __future__ import annotations

from typing import Any

import lightning as L
from loguru import logger

from ae.data.datamodule import ShardDataModule


class EpochSync(L.Callback):
    """Keeps the data order in step with the trainer's epoch (shuffle and plan per epoch).

    Epoch 0's iterator is created before this hook runs; `train_dataloader()` covers it. A resumed
    epoch gets no epoch-start hook: the loader's restored state sets its epoch."""

    def on_train_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        dm = trainer.datamodule
        if isinstance(dm, ShardDataModule):
            dm.set_epoch(trainer.current_epoch)
            dm.trained_batches = 0
            logger.debug(f"Data epoch set to {trainer.current_epoch}")

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, idx: int
    ) -> None:
        """Counts the epoch's batches before any checkpoint of this batch is saved (the step
        boundary comes later in the callback list): the loader itself is a batch ahead."""
        dm = trainer.datamodule
        if isinstance(dm, ShardDataModule):
            dm.trained_batches = idx + 1
