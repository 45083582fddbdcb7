"""Reconstruction sampling at each epoch end (image data, `--sample_every_epoch`) and every
`--sample_period` optimizer steps, which can never OOM the run.

Each rank reconstructs `--num_sample_batches` batches of `--sample_batch_size` samples from the
start of its own validation slot (the same samples every time, so successive grids show
progress), logs the reconstruction loss, and rank 0 saves a PNG grid of inputs above
reconstructions (image data) to `<output_dir>/samples/step_<N>.png`. With `--ema_decay`, the
reconstructions are the averaged weights' (those validation and `ae-encode` use).

Sampling uses the bare LightningModule (not the DDP wrapper) and makes no collective call, so a
rank that fails or skips it cannot desynchronize the others. It runs after a checkpoint save of
the same step (`ae.training.step_boundary`), with memory freed first; `SAMPLING START/END`
bracket it with memory figures. An out-of-memory error is caught, logged with memory at failure
and after freeing, the sampling batch is halved for next time (turned off below 1), and training
goes on.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable

import lightning as L
import numpy as np
import torch
from loguru import logger
from torch import nn

from ae.config import ObservabilityConfig
from ae.data.stream.shard_stream import ShardStream
from ae.forensics.faults import fault_point
from ae.forensics.process_stats import memory_summary
from ae.forensics.progress import in_phase, progress
from ae.log_lines import SAMPLING_END, SAMPLING_OOM, SAMPLING_START, main_log
from ae.run_paths import RunDir
from ae.training.ema import averaged_weights
from ae.training.metrics import log_grid
from ae.training.model import LOSSES
from ae.training.model_build import has_codec
from ae.training.plots import reconstruction_grid


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


def reconstruct(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """decode(encode(x)): every AutoEncoder has both; a user LightningModule without them gets
    no sampling (`Sampling.sample`)."""
    return model.decode(model.encode(x))


def pixel_loss(model: nn.Module) -> tuple[str, Callable[..., torch.Tensor]]:
    """(name, function) of the run's pixel loss (`--loss`: what `val/recon` averages), so that
    the sampled reconstructions' loss reads like the run's own; MSE for a model of the user's
    without one of ae's."""
    fn = getattr(model, "recon_loss", None)
    name = next((name for name, f in LOSSES.items() if f is fn), None)
    return (name, fn) if name is not None and fn is not None else ("mse", nn.functional.mse_loss)


def _source(trainer: L.Trainer) -> ShardStream:
    """The stream the grids show: validation's, or training's with --val_shards=none."""
    dm = trainer.datamodule
    return dm.val_set if dm.val_set is not None else dm.train_set


class Sampling(L.Callback):
    def __init__(self, obs: ObservabilityConfig, run_dir: RunDir) -> None:
        self.period = obs.sample_period
        self.every_epoch = obs.sample_every_epoch
        self.batch_size = obs.sample_batch_size  # halved after an out-of-memory error
        self.num_batches = obs.num_sample_batches
        self.out_dir = run_dir.samples
        self._inputs: torch.Tensor | None = None  # CPU, num_batches x the initial batch size
        self._sampled_step = -1  # an epoch end on a periodic sampling step samples once

    def after_step(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """After optimizer step `trainer.global_step`, unless stopping (`StepBoundary`)."""
        if self.period > 0 and trainer.global_step % self.period == 0:
            self.sample(trainer, pl_module)

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        images = _source(trainer).spec.kind == "image"
        if self.every_epoch and images and not trainer.should_stop:
            self.sample(trainer, pl_module)

    def sample_inputs(self, trainer: L.Trainer) -> torch.Tensor:
        """The first samples of this rank's validation slot (of its train slot with
        --val_shards=none), read once (no worker, no log lines of the data pipeline)."""
        if self._inputs is None:
            wanted = self.num_batches * self.batch_size
            arrays = _source(trainer).first_samples(trainer.global_rank, wanted)
            self._inputs = torch.from_numpy(np.stack(arrays)) if arrays else torch.empty(0)
        return self._inputs[: self.num_batches * self.batch_size]

    def sample(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        step = trainer.global_step
        if step == self._sampled_step:
            return
        self._sampled_step = step
        if not has_codec(pl_module):  # a LightningModule of the user's without encode/decode
            self.period, self.every_epoch = -1, False
            main_log.info("No reconstruction samples: the model has no encode(x) and decode(z)")
            return
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
                    f"Sampling at step {step}: reconstruction loss ({pixel_loss(pl_module)[0]}) "
                    f"{loss:.6f} "
                    f"({len(inputs)} samples per device)"
                )
                if trainer.is_global_zero and inputs.dim() == 4:
                    path = self.out_dir / f"step_{step:08d}.png"
                    grid = reconstruction_grid(inputs.numpy(), recon.numpy(), path)
                    log_grid(trainer.loggers, grid, step)
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
        _, loss_fn = pixel_loss(pl_module)
        was_training = pl_module.training
        pl_module.eval()
        try:
            with (
                averaged_weights(trainer, pl_module),
                torch.no_grad(),
                trainer.precision_plugin.forward_context(),
            ):
                for chunk in inputs.split(self.batch_size):
                    fault_point("sampling", progress.step)
                    x = chunk.to(pl_module.device)
                    y = reconstruct(pl_module, x).float()
                    losses.append(loss_fn(y, x).item())
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
            self.period, self.every_epoch = -1, False
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
