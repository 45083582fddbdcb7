"""The callback that applies the position on every resume, and says per epoch what each rank
trained (`EPOCH_TRAINED`, which `ae-diagnose --json` sums per attempt)."""

from __future__ import annotations

from typing import Any

import lightning as L
import torch
from loguru import logger

from ae.data.datamodule import ShardDataModule
from ae.log_lines import EPOCH_TRAINED
from ae.training.position.arithmetic import EpochPosition, resumed_position
from ae.training.position.lightning_progress import BATCH_PROGRESS, reconcile_fit_loop


def legacy_position(checkpoint: dict[str, Any]) -> dict[str, Any] | None:
    """The train position of a checkpoint from before the data module kept it: where Lightning
    kept its loader's (the fit loop's state), resumed alike with the same settings."""
    fit = checkpoint.get("loops", {}).get("fit_loop", {})
    loaders = fit.get("state_dict", {}).get("combined_loader") or [{}]
    progress = fit.get(BATCH_PROGRESS, {}).get("current", {})
    if "epoch" in loaders[0] and "processed" in progress:
        return {"train": {"epoch": loaders[0]["epoch"], "batches": progress["processed"]}}
    return None


class PositionSync(L.Callback):
    """On resume, after the data module restored its position and before Lightning restores its
    loops: sets Lightning's fit-loop progress from ae's position (`lightning_progress`), so that
    Lightning never decides on its own whether the checkpoint ended its epoch."""

    def __init__(self) -> None:
        self.resumed: EpochPosition | None = None  # where the run resumed, if it did
        self._samples = 0  # trained by this rank in the current epoch, this run
        self._batches = 0

    def on_load_checkpoint(
        self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        dm = trainer.datamodule
        if not isinstance(dm, ShardDataModule):
            return
        if type(dm).__qualname__ not in checkpoint and (old := legacy_position(checkpoint)):
            dm.load_state_dict(old)
        resume, stream = dm.resumed, dm.train_set
        if resume is None or stream is None:
            return
        _, length, _ = dm.epoch_lengths()
        self.resumed = resumed_position(
            saved_epoch=resume.saved_epoch, resume_epoch=resume.epoch,
            batches=dm.trained_batches, length=length,
            samples=resume.trained_samples(stream.world_size, stream.batch_size),
        )  # fmt: skip
        fit = checkpoint.get("loops", {}).get("fit_loop")
        if fit is not None and BATCH_PROGRESS in fit:
            checkpoint["loops"]["fit_loop"] = reconcile_fit_loop(fit, self.resumed)

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, idx: int
    ) -> None:
        if isinstance(batch, torch.Tensor):  # its shape, not len(): no Python-level call
            self._samples += batch.shape[0]
        self._batches += 1

    def _report(self, trainer: L.Trainer) -> None:
        if self._batches == 0:
            return
        dm = trainer.datamodule
        upto = dm.trained_batches if isinstance(dm, ShardDataModule) else self._batches
        logger.info(
            EPOCH_TRAINED.format(
                epoch=trainer.current_epoch, samples=self._samples, batches=self._batches,
                upto=upto, length=trainer.num_training_batches,
            )
        )  # fmt: skip
        self._samples = self._batches = 0

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._report(trainer)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._report(trainer)  # an epoch that training stopped in (if Lightning did not end it)
