"""Follows Lightning's loop on each rank: SPEC markers and progress lines into the debug log, and
progress beats for the stall watchdog.

Markers (`========== EPOCH e TRAINING START ==========` ...) are INFO: they are in every run.
Progress lines come every `log_every_n_*_batches`; with `--debug` a `Training step` line comes
for every batch, with throughput and memory. `TRAINING END` is written after the epoch's last
training batch, *before* the epoch-end validation, so a hang between the two is placed.

Beats (`ae.progress`): a batch handed to the training step is progress in phase "training step"
(with the optimizer step); from the end of a step until the next batch arrives the rank is in
"data loading" (the fetch, and Lightning's per-step SIGTERM broadcast); validation batches beat in
"validation". They live here rather than in a callback of their own: Lightning calls every hook
of every callback each step, and one more callback costs more than the beats themselves.
"""

from __future__ import annotations

import time
from typing import Any

import lightning as L
import torch
from loguru import logger

from ae.log_lines import PROCESSED_TRAIN, TRAIN_STEP, VAL_STEP, epoch_marker, main_log
from ae.memory import memory_summary
from ae.progress import progress
from logging_cfg import debug_line


class DebugCallback(L.Callback):
    def __init__(self, *, debug: bool, every_train: int, every_val: int) -> None:
        self.debug = debug
        self.every_train = every_train
        self.every_val = every_val
        self._epoch_t0 = 0.0
        self._last_t = 0.0
        self._batches = 0
        self._train_open = False

    # --- training ---------------------------------------------------------------------------
    def on_train_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._epoch_t0 = self._last_t = time.perf_counter()
        self._batches = 0
        self._train_open = True
        progress.enter("data loading", epoch=trainer.current_epoch)
        logger.info(epoch_marker(trainer.current_epoch, "TRAINING", "START"))

    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, idx: int
    ) -> None:
        progress.enter("training step", step=trainer.global_step)
        # A resumed epoch gets no epoch-start hook from Lightning: open it at its first batch.
        if not self._train_open:
            self._epoch_t0 = self._last_t = time.perf_counter()
            self._batches = idx
            self._train_open = True
            marker = epoch_marker(trainer.current_epoch, "TRAINING", "START")
            logger.info(f"{marker} (resumed at batch {idx})")

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, idx: int
    ) -> None:
        progress.enter("data loading", step=trainer.global_step)
        self._batches += 1
        on_cadence = self._batches % self.every_train == 0
        if self.debug or on_cadence:
            # .item() syncs with the device: only on the lines that print the loss.
            loss = outputs["loss"].item() if isinstance(outputs, dict) else float("nan")
            if self.debug:  # per batch: the cheap path, not logger.debug
                debug_line(self._step_line(trainer, loss, self._debug_detail(trainer, batch)))
            if on_cadence:
                logger.info(self._processed_line(trainer))
                if not self.debug:
                    logger.info(self._step_line(trainer, loss, ""))
        self._last_t = time.perf_counter()
        if self._batches == trainer.num_training_batches:
            self._end_training(trainer)

    def _debug_detail(self, trainer: L.Trainer, batch: Any) -> str:
        batch_n = len(batch) if isinstance(batch, torch.Tensor) else 0
        rate = batch_n / max(time.perf_counter() - self._last_t, 1e-9)
        lr = trainer.optimizers[0].param_groups[0]["lr"] if trainer.optimizers else 0.0
        return f", lr={lr:.3g}, {rate:.0f} samples/s, {memory_summary()}"

    @staticmethod
    def _step_line(trainer: L.Trainer, loss: float, detail: str) -> str:
        return TRAIN_STEP.format(step=trainer.global_step, loss=f"{loss:.6f}", detail=detail)

    def _processed_line(self, trainer: L.Trainer) -> str:
        rate = self._batches / max(time.perf_counter() - self._epoch_t0, 1e-9)
        return PROCESSED_TRAIN.format(
            batches=self._batches, epoch=trainer.current_epoch, rate=f"{rate:.2f}"
        )

    def _end_training(self, trainer: L.Trainer) -> None:
        if not self._train_open:
            return
        self._train_open = False
        logger.info(self._processed_line(trainer))
        logger.info(epoch_marker(trainer.current_epoch, "TRAINING", "END"))

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._end_training(trainer)
        metrics = {k: float(v) for k, v in trainer.callback_metrics.items() if v.numel() == 1}
        shown = ", ".join(f"{k}={v:.5f}" for k, v in sorted(metrics.items()) if "/" in k)
        main_log.info(
            f"Epoch {trainer.current_epoch} done: {self._batches} batches in "
            f"{time.perf_counter() - self._epoch_t0:.1f}s, step {trainer.global_step}; {shown}"
        )

    # --- validation -------------------------------------------------------------------------
    def on_validation_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        progress.enter("validation")
        if trainer.sanity_checking:
            return
        self._val_batches = 0
        logger.info(epoch_marker(trainer.current_epoch, "VALIDATION", "START"))

    def on_validation_batch_end(
        self,
        trainer: L.Trainer,
        pl_module: L.LightningModule,
        outputs: Any,
        batch: Any,
        idx: int,
        dataloader_idx: int = 0,
    ) -> None:
        progress.beat()
        if trainer.sanity_checking:
            return
        self._val_batches += 1
        if self._val_batches % self.every_val == 0 or self.debug:
            loss = outputs.item() if isinstance(outputs, torch.Tensor) else float("nan")
            detail = f" (global step {trainer.global_step})"
            log = debug_line if self._val_batches % self.every_val else logger.info
            log(VAL_STEP.format(step=self._val_batches, loss=f"{loss:.6f}", detail=detail))

    def on_validation_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        progress.enter("data loading")
        if trainer.sanity_checking:
            return
        logger.info(f"Validated {self._val_batches} batches")
        logger.info(epoch_marker(trainer.current_epoch, "VALIDATION", "END"))

    # --- end --------------------------------------------------------------------------------
    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        progress.enter("teardown")

    def on_exception(
        self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException
    ) -> None:
        progress.enter("teardown")
