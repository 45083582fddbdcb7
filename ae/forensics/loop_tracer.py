"""Follows Lightning's loop on each rank: the markers and progress lines of the grep table
(docs/CONTRACT.md) into the debug log, and progress beats for the stall watchdog.

Markers (`========== EPOCH e TRAINING START ==========` ...) are INFO: they are in every run.
Progress lines come every `log_every_n_*_batches`; with `--debug` a `Training step` line comes
for every batch, with throughput and memory. `TRAINING END` is written after the epoch's last
training batch, *before* the epoch-end validation, so a hang between the two is placed.

Beats (`ae.forensics.progress`): a batch handed to the training step is progress in phase
"training step" (with the optimizer step); from the end of a step until the next batch arrives
the rank is in "data loading" (the fetch, and Lightning's per-step SIGTERM broadcast); validation
batches beat in "validation". They live here rather than in a callback of their own: Lightning
calls every hook of every callback each step, and one more callback costs more than the beats.
The step clock (`ae.forensics.step_times`) is closed here too, at the end of each batch, and each
epoch ends with a `Step times` line in the train log (one all-gather of four numbers per rank),
and a `Throughput` line: samples/s, the slowest rank's split of a step, and what bounds the job
(`ae.stragglers`), with what would feed an input-bound one faster.

`AE_CUDA_SYNC_DEBUG=warn` (or `error`) turns on torch's CUDA sync debug mode in each rank from
the first training batch on (setup's syncs are left out): every device-to-host sync then warns,
with its stack, in the rank's logs. It is how a GPU run shows which syncs a step has
(docs/BENCHMARKS.md, issue 37).
"""

from __future__ import annotations

import math
import os
import statistics
import time
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
from loguru import logger

from ae.forensics.process_stats import memory_summary
from ae.forensics.progress import progress
from ae.forensics.step_times import step_times
from ae.log_lines import (
    EPOCH_STEP_TIMES,
    PROCESSED_TRAIN,
    TRAIN_PROGRESS,
    TRAIN_STEP,
    VAL_STEP,
    epoch_marker,
    main_log,
)
from ae.stragglers import epoch_line
from logging_cfg import debug_line

SYNC_DEBUG_ENV = "AE_CUDA_SYNC_DEBUG"  # warn | error: torch.cuda.set_sync_debug_mode in training
# The console's TRAIN_PROGRESS line (rank 0, no progress bar): the first this long into an epoch,
# then at this interval. An epoch of hours said nothing between its start and its end.
CONSOLE_PROGRESS_FIRST_S, CONSOLE_PROGRESS_EVERY_S = 60.0, 600.0


class DebugCallback(L.Callback):
    def __init__(
        self,
        *,
        debug: bool,
        every_train: int,
        every_val: int,
        batch_size: int | None = None,
        num_workers: int | None = None,
    ) -> None:
        self.debug = debug
        self.every_train = every_train
        self.every_val = every_val
        # For the epoch's Throughput line: samples per batch per rank, the loader's workers
        self.batch_size = batch_size
        self.num_workers = num_workers
        self._epoch_t0 = 0.0
        self._last_t = 0.0
        # When the next TRAIN_PROGRESS line is due (perf_counter; set as an epoch opens)
        self._console_at = math.inf
        self._batches = 0
        self._resumed_at = 0  # the batch a resumed epoch started at in this run (0: from the top)
        self._train_open = False
        self._global_step = 0  # at the previous batch end: tells an optimizer step
        self._validated = False  # this training epoch ran a validation
        # The epoch-end all-gather's tensors, allocated once and kept until the run ends (as
        # `ae.data.rank_agreement.same_on_all_ranks` keeps its: freed while gloo's thread held
        # one, a dataloader worker forked meanwhile could hang at birth; validation forks next).
        self._gathered: list[torch.Tensor] = []

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if (mode := os.environ.get(SYNC_DEBUG_ENV)) and torch.cuda.is_available():
            torch.cuda.set_sync_debug_mode(mode)

    # --- training ---------------------------------------------------------------------------
    def on_train_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._epoch_t0 = self._last_t = time.perf_counter()
        self._console_at = self._epoch_t0 + CONSOLE_PROGRESS_FIRST_S
        self._batches = self._resumed_at = 0
        self._train_open = True
        self._validated = False
        self._global_step = trainer.global_step
        step_times.new_epoch()
        progress.enter("data loading", epoch=trainer.current_epoch)
        logger.info(epoch_marker(trainer.current_epoch, "TRAINING", "START"))

    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, idx: int
    ) -> None:
        progress.enter("training step", step=trainer.global_step)
        # A resumed epoch gets no epoch-start hook from Lightning: open it at its first batch.
        if not self._train_open:
            self._epoch_t0 = self._last_t = time.perf_counter()
            self._console_at = self._epoch_t0 + CONSOLE_PROGRESS_FIRST_S
            self._batches = self._resumed_at = idx
            self._train_open = True
            self._global_step = trainer.global_step
            progress.beat(
                epoch=trainer.current_epoch
            )  # the heartbeat's epoch, as at an epoch start
            marker = epoch_marker(trainer.current_epoch, "TRAINING", "START")
            logger.info(f"{marker} (resumed at batch {idx})")

    def on_before_optimizer_step(
        self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: torch.optim.Optimizer
    ) -> None:
        # Backward has just returned (the optimizer step starts): a hook the step already
        # dispatches, where `on_after_backward` would cost one more a batch. A batch that only
        # accumulates has no all-reduce to time (DDP's no_sync).
        step_times.backward_done(time.perf_counter())

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, idx: int
    ) -> None:
        step, now = trainer.global_step, time.perf_counter()  # the one clock read a batch
        step_times.batch_end(now, step - self._global_step)
        self._global_step = step
        self._batches += 1
        on_cadence = self._batches % self.every_train == 0
        # The console line once in minutes (rank 0, no progress bar)
        console = now >= self._console_at
        if console:
            self._console_at = now + CONSOLE_PROGRESS_EVERY_S
            console = trainer.global_rank == 0 and trainer.progress_bar_callback is None
        loss = float("nan")
        if (self.debug or on_cadence or console) and isinstance(outputs, dict):
            # .item() waits for the device to finish the step: only on the lines that print the
            # loss, and still in `training step`, so a kernel that hangs is reported as the step
            # it is (on an H200 a hung kernel read as `data loading`: bench/gpu_proof).
            loss = outputs["loss"].item()
        progress.enter("data loading", step=step)
        if self.debug or on_cadence:
            if self.debug:  # per batch: the cheap path, not logger.debug
                debug_line(self._step_line(trainer, loss, self._debug_detail(trainer, batch)))
            if on_cadence:
                logger.info(self._processed_line(trainer))
                if not self.debug:
                    logger.info(self._step_line(trainer, loss, ""))
        if console:
            self._say_progress(trainer, loss)
        self._last_t = now
        if self._batches == trainer.num_training_batches:
            self._end_training(trainer)

    def _say_progress(self, trainer: L.Trainer, loss: float) -> None:
        """How far the epoch is, its rate and what is left of it (TRAIN_PROGRESS: train log and
        console)."""
        ran = self._batches - self._resumed_at  # this run's part of a resumed epoch
        rate = ran / max(time.perf_counter() - self._epoch_t0, 1e-9)
        planned = trainer.num_training_batches
        known = isinstance(planned, int) and planned > 0
        left = (planned - self._batches) / rate if known and rate > 0 else None
        main_log.info(TRAIN_PROGRESS.format(
            epoch=trainer.current_epoch, batch=self._batches,
            batches=planned if known else "?",
            pct=f"{100 * self._batches / planned:.0f}" if known else "?",
            rate=f"{rate:.3g}", eta=_duration(left) if left is not None else "?",
            step=trainer.global_step, loss=f"{loss:.5g}" if loss == loss else "?",
        ))  # fmt: skip

    def _debug_detail(self, trainer: L.Trainer, batch: Any) -> str:
        batch_n = len(batch) if isinstance(batch, torch.Tensor) else 0
        rate = batch_n / max(time.perf_counter() - self._last_t, 1e-9)
        lr = trainer.optimizers[0].param_groups[0]["lr"] if trainer.optimizers else 0.0
        detail = f", lr={lr:.3g}, {rate:.0f} samples/s"
        if (times := step_times.last) is not None:  # this batch, in ms
            _, _, data, compute, sync = times
            detail += (
                f", own={1000 * (data + compute):.1f}ms (data {1000 * data:.1f}, compute "
                f"{1000 * compute:.1f}), sync={1000 * sync:.1f}ms"
            )
        return f"{detail}, {memory_summary()}"

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
        self._step_times_line(trainer, pl_module)
        planned = trainer.num_training_batches
        whole = not isinstance(planned, int) or self._batches >= planned
        how = "done" if whole else (
            f"{'interrupted' if progress.stop_signal else 'stopped'} at batch {self._batches} "
            f"of {planned}"
        )  # fmt: skip
        # A resumed epoch's time is this run's part of it only: say which part
        ran = f" ({self._batches - self._resumed_at} since the resume)" if self._resumed_at else ""
        metrics = self._epoch_metrics(trainer, whole)
        main_log.info(
            f"Epoch {trainer.current_epoch} {how}: {self._batches} batches{ran} in "
            f"{time.perf_counter() - self._epoch_t0:.1f}s, step {trainer.global_step}"
            + (f"; {metrics}" if metrics else "")
        )

    def _epoch_metrics(self, trainer: L.Trainer, whole: bool) -> str:
        """This epoch's values only: the epoch's mean train loss (logged at its last batch: not
        in an epoch cut short), and the val values if it validated. The step-cadence values
        (`train/loss` ...) belong to the last logged step, the others to an earlier epoch."""
        metrics = {k: float(v) for k, v in trainer.callback_metrics.items() if v.numel() == 1}
        keep = {"train/loss_epoch"} if whole else set()
        if self._validated:
            keep |= {k for k in metrics if k.startswith("val/")}
        return ", ".join(f"{k}={v:.5f}" for k, v in sorted(metrics.items()) if k in keep)

    def _step_times_line(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """Rank 0 logs the spread of the ranks' own time per step over the epoch. Every rank
        takes part in the all-gather (this hook runs on all of them)."""
        if not self._gathered:
            self._gathered = [torch.zeros(4, dtype=torch.float64, device=pl_module.device)
                              for _ in range(trainer.world_size + 1)]  # fmt: skip
        mine, parts = self._gathered[0], self._gathered[1:]
        mine.copy_(torch.tensor(step_times.epoch, dtype=torch.float64))
        # torch.distributed's own all-gather: Lightning's goes through the autograd-aware
        # `torch.distributed.nn.functional.all_gather`, deprecated in torch (a WARNING a rank).
        if trainer.world_size > 1:
            dist.all_gather(parts, mine)
        else:
            parts[0].copy_(mine)
        rows = torch.stack(parts).tolist()
        if trainer.global_rank != 0:
            return
        ranked = [(r, 1000 * (d + c) / n, 100 * d / (d + c)) for r, (n, d, c, _) in enumerate(rows)
                  if n > 0 and d + c > 0]  # fmt: skip
        if not ranked:
            return
        own = sorted(o for _, o, _ in ranked)
        waits = sorted(w for _, _, w in ranked)
        main_log.info(
            EPOCH_STEP_TIMES.format(
                epoch=trainer.current_epoch, ranks=len(rows), own_min=f"{own[0]:.1f}",
                own_median=f"{statistics.median(own):.1f}", own_max=f"{own[-1]:.1f}",
                slowest=max(ranked, key=lambda x: x[1])[0], data_min=f"{waits[0]:.0f}",
                data_median=f"{statistics.median(waits):.0f}", data_max=f"{waits[-1]:.0f}",
            )
        )  # fmt: skip
        if self.batch_size is None:
            return
        samples = self.batch_size * trainer.world_size * trainer.accumulate_grad_batches
        # The CPUs this node's ranks may use, that their workers share (no affinity on macOS)
        affinity = getattr(os, "sched_getaffinity", None)
        cpus = len(affinity(0)) if affinity is not None else os.cpu_count()
        line = epoch_line(
            trainer.current_epoch, rows, samples, num_workers=self.num_workers,
            local_ranks=trainer.num_devices, cpus=cpus,
        )  # fmt: skip
        if line is not None:
            main_log.info(line)

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
        step_times.restart()  # validation is no part of the next training step
        if trainer.sanity_checking:
            return
        self._validated = True
        logger.info(f"Validated {self._val_batches} batches")
        logger.info(epoch_marker(trainer.current_epoch, "VALIDATION", "END"))

    # --- end --------------------------------------------------------------------------------
    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        progress.enter("teardown")

    def on_exception(
        self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException
    ) -> None:
        progress.enter("teardown")


def _duration(seconds: float) -> str:
    """`42s`, `17m`, `3h05m`: an ETA at a glance."""
    if seconds < 60:
        return f"{seconds:.0f}s"
    minutes = round(seconds / 60)
    return f"{minutes}m" if minutes < 60 else f"{minutes // 60}h{minutes % 60:02d}m"
