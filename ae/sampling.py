"""Reconstruction sampling every `--sample_period` optimizer steps, which can never OOM the run.

Each rank reconstructs `--num_sample_batches` batches of `--sample_batch_size` samples from the
start of its own validation slot (the same samples every time, so successive grids show
progress), logs the reconstruction loss, and rank 0 saves a PNG grid of inputs above
reconstructions (image data) to `<output_dir>/samples/step_<N>.png`.

Sampling uses the bare LightningModule (not the DDP wrapper) and makes no collective call, so a
rank that fails or skips it cannot desynchronize the others. It runs after a checkpoint save of
the same step (callback order), with memory freed first; `SAMPLING START/END` bracket it with
memory figures. An out-of-memory error is caught, logged with memory at failure and after
freeing, the sampling batch is halved for next time (turned off below 1), and training goes on.
"""

from __future__ import annotations

import gc
import itertools
import time
from pathlib import Path
from typing import Any

import lightning as L
import numpy as np
import torch
from loguru import logger
from torch import nn

from ae.config import Config
from ae.data_errors import ErrorCounts, SlotErrors
from ae.dataset import decode_samples, read_slices
from ae.fault_injection import fault_point
from ae.log_lines import SAMPLING_END, SAMPLING_OOM, SAMPLING_START, main_log
from ae.memory import memory_summary
from ae.plots import reconstruction_grid
from ae.progress import in_phase, progress


def is_oom(error: BaseException) -> bool:
    return isinstance(error, torch.cuda.OutOfMemoryError) or (
        isinstance(error, RuntimeError) and "out of memory" in str(error).lower()
    )


def free_memory(collect: bool = False) -> None:
    """Give cached GPU blocks back; `collect` also runs the cycle collector (slow: up to a second
    in a large process), needed after an exception whose traceback holds tensors."""
    if collect:
        gc.collect()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()


class Sampling(L.Callback):
    def __init__(self, cfg: Config) -> None:
        self.period = cfg.sample_period
        self.batch_size = cfg.sample_batch_size  # halved after an out-of-memory error
        self.num_batches = cfg.num_sample_batches
        self.out_dir = Path(cfg.output_dir) / "samples"
        self._inputs: torch.Tensor | None = None  # CPU, num_batches x the initial batch size
        self._seen_step = -1

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._seen_step = trainer.global_step

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, idx: int
    ) -> None:
        step = trainer.global_step
        if step == self._seen_step:
            return
        self._seen_step = step
        if self.period > 0 and step % self.period == 0 and not trainer.should_stop:
            self.sample(trainer, pl_module)

    def sample_inputs(self, trainer: L.Trainer) -> torch.Tensor:
        """The first samples of this rank's validation slot, read once (no worker, no log
        lines of the data pipeline)."""
        if self._inputs is None:
            stream = trainer.datamodule.val_set
            plan = stream.plan()
            wanted = self.num_batches * self.batch_size
            # A table of its own: the val workers already count this slot's bad data.
            errors = SlotErrors(ErrorCounts.create(1), 0)
            slices = plan.slot_slices(trainer.global_rank, 0)
            samples = decode_samples(read_slices(stream.urls, slices, errors), stream.spec, errors)
            arrays = list(itertools.islice(samples, wanted))
            self._inputs = torch.from_numpy(np.stack(arrays)) if arrays else torch.empty(0)
        return self._inputs[: self.num_batches * self.batch_size]

    def sample(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        step = trainer.global_step
        with in_phase("sampling"):
            free_memory()  # a checkpoint save of this step may have just run
            logger.info(
                SAMPLING_START.format(
                    step=step,
                    batches=self.num_batches,
                    batch_size=self.batch_size,
                    memory=memory_summary(),
                )
            )
            t0 = time.perf_counter()
            inputs = self.sample_inputs(trainer)
            error, at_failure = None, ""
            try:
                losses, recon = self._reconstruct(trainer, pl_module, inputs)
            except Exception as e:
                if not is_oom(e):
                    raise
                error = f"{type(e).__name__}: {str(e).splitlines()[0]}"
                at_failure = memory_summary()
            # Outside the except block: its traceback no longer pins the failed batch's tensors.
            free_memory(collect=error is not None)
            if error is not None:
                outcome = self._after_oom(step, error, at_failure)
            elif not losses:
                outcome = "no validation samples on this rank"
            else:
                loss = float(np.mean(losses))
                outcome = f"reconstruction loss={loss:.6f} over {len(inputs)} samples"
                (main_log if trainer.is_global_zero else logger).info(
                    f"Sampling at step {step}: reconstruction loss {loss:.6f} "
                    f"({len(inputs)} samples per device)"
                )
                if trainer.is_global_zero and inputs.dim() == 4:
                    path = self.out_dir / f"step_{step:08d}.png"
                    reconstruction_grid(inputs.numpy(), recon.numpy(), path)
                    outcome += f", grid {path}"
            seconds = f"{time.perf_counter() - t0:.2f}"
            logger.info(
                SAMPLING_END.format(
                    step=step, outcome=outcome, seconds=seconds, memory=memory_summary()
                )
            )

    def _reconstruct(
        self, trainer: L.Trainer, pl_module: L.LightningModule, inputs: torch.Tensor
    ) -> tuple[list[float], torch.Tensor]:
        losses, outputs = [], []
        was_training = pl_module.training
        pl_module.eval()
        try:
            with torch.no_grad(), trainer.precision_plugin.forward_context():
                for chunk in inputs.split(self.batch_size):
                    fault_point("sampling", progress.step)
                    x = chunk.to(pl_module.device)
                    y = pl_module(x).float()
                    losses.append(nn.functional.mse_loss(y, x).item())
                    outputs.append(y.cpu())
        finally:
            pl_module.train(was_training)
        return losses, torch.cat(outputs) if outputs else torch.empty(0)

    def _after_oom(self, step: int, error: str, at_failure: str) -> str:
        failed = self.batch_size
        if failed > 1:
            self.batch_size = failed // 2
            action = f"sampling batch halved to {self.batch_size} for next time"
        else:
            self.period = -1
            action = "sampling turned off for the rest of the run (out of memory at batch 1)"
        logger.warning(
            SAMPLING_OOM.format(
                step=step,
                batch_size=failed,
                error=error,
                at_failure=at_failure,
                after=memory_summary(),
                action=action,
            )
        )
        return f"out of memory, {action}"
