"""A loss or gradient that turns NaN or Inf: named (rank, step, shard and samples), and survived
as `--on_nonfinite` says.

Every optimizer step, each rank records on its device, without reading it: its loss (summed
over the step's batches), whether its own gradient was finite before the all-reduce (a DDP comm
hook sums each bucket before reducing it), and the norm of the reduced gradient. The record
is read on the host every step where that costs nothing or is needed (on a CPU, and with
`skip` or `rollback`, which must decide before the optimizer step), and otherwise (`stop` on a
GPU) every `log_every_n_steps` steps, when the loggers read the loss anyway; the first bad step
is named from the window kept since the last read.

Agreement without a collective of its own: a rank whose loss is non-finite puts a NaN into
the step's first gradient bucket before reducing it, so the reduced gradient, which every rank
holds identically, is non-finite on all ranks whenever any rank's loss or gradient is. Every
rank then takes the same decision at the same step from the same value. The rank(s) whose own
loss or pre-reduce gradient held the value write the NONFINITE line; the others write
NONFINITE_RECEIVED. Under 16-mixed, a non-finite gradient with finite losses is the gradient
scaler's overflow (it skips that step and lowers its scale): only a loss counts there.

- `stop`: every rank raises `NonFiniteError` (exit 2, after naming the newest checkpoint; the
  save guard keeps any checkpoint due meanwhile from being written).
- `skip`: the step's gradients are dropped (`grad = None`: the optimizer leaves every parameter
  and its state as they were), on every rank; up to `--max_skipped_steps`. Its loss stays out
  of the epoch's mean (`ae.training.epoch_loss`), the rolled-back step's too.
- `rollback`: the step is dropped too, then weights, optimizer state and the EMA go back to the
  newest step checkpoint; the data stream goes on, so the batches since that checkpoint are not
  trained again (the step counter and the LR schedule go on as well).

A loss spike (a finite loss above `SPIKE_FACTOR` x its exponential mean over about
`1 / (1 - SPIKE_DECAY)` steps, after `SPIKE_WARMUP` steps) is a LOSS_SPIKE WARNING with the
same detail, on the rank that saw it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
from loguru import logger
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.nn.parallel import DistributedDataParallel

from ae.config import CheckpointConfig, OptimConfig
from ae.data.stream.batch_members import Member, batch_members, describe_members
from ae.data.stream.shard_stream import ShardStream
from ae.errors import UserError
from ae.forensics.step_times import gradients_ready
from ae.log_lines import (
    LOSS_SPIKE,
    NONFINITE,
    NONFINITE_RECEIVED,
    NONFINITE_SKIPPED,
    NONFINITE_STOP,
    NONFINITE_SUMMARY,
    ROLLBACK,
    main_log,
)
from ae.training.checkpoint_files import CheckpointStore
from ae.training.ema import EMA
from ae.training.epoch_loss import EpochLoss
from ae.training.optimizer import MeasuredNorm
from ae.training.position import checkpoint_read

SPIKE_FACTOR = 10.0  # a loss this many times its recent mean is a spike
SPIKE_DECAY = 0.98  # the mean's decay per step (about the last 50 steps)
SPIKE_WARMUP = 20  # steps before the first spike can be called (the mean settles)


class NonFiniteError(UserError):
    """The run stops on a non-finite value (`--on_nonfinite=stop`, or past
    `--max_skipped_steps`)."""


@dataclass
class StepRecord:
    step: int  # the optimizer step, counted as ae counts them (the first is 1)
    batches: list[tuple[int, int]] = field(default_factory=list)  # (epoch, batch index)
    # On the device, unread until the window is: the step's loss, the norm of its reduced
    # gradient, and (under DDP) the sum of this rank's own gradient before the all-reduce
    # (non-finite exactly when one of its elements is).
    values: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None] | None = None


def _value(x: float) -> str:
    return "nan" if math.isnan(x) else ("inf" if x > 0 else "-inf")


def nonfinite_in(named: list[tuple[str, torch.Tensor]]) -> str | None:
    """The first name whose tensor holds a NaN or Inf (floating tensors only), or None. One
    host sync: for the save guard and the step just recorded, never per step."""
    floats = [(n, t) for n, t in named if torch.is_tensor(t) and t.is_floating_point()]
    if not floats:
        return None
    # One stack per device: on a GPU the optimizer's `step` counters stay on the CPU beside
    # CUDA weights, and torch.stack refuses a mix (seen on an H200: bench/gpu_proof).
    by_device: dict[torch.device, list[int]] = {}
    for i, (_, t) in enumerate(floats):
        by_device.setdefault(t.device, []).append(i)
    ok = [True] * len(floats)
    for idx in by_device.values():
        flags = torch.stack([torch.isfinite(floats[i][1]).all() for i in idx]).tolist()
        for i, flag in zip(idx, flags, strict=True):
            ok[i] = flag
    return next((n for (n, _), fine in zip(floats, ok, strict=True) if not fine), None)


def training_state(trainer: L.Trainer, pl_module: L.LightningModule) -> list[tuple[str, Any]]:
    """What a checkpoint would hold of the model and the optimizers, named. Identical on every
    rank under DDP, so a decision on it needs no collective."""
    named: list[tuple[str, Any]] = [(f"weights {n}", t) for n, t in pl_module.state_dict().items()]
    for i, opt in enumerate(trainer.optimizers):
        for j, state in enumerate(opt.state.values()):
            named += [(f"optimizer {i} state {j} {k}", v) for k, v in state.items()]
    return named


class NonFiniteGuard(L.Callback):
    """Before `StepBoundary` in the callbacks: a rollback is done before anything is saved."""

    def __init__(
        self, optim: OptimConfig, checkpoints: CheckpointConfig, store: CheckpointStore,
        precision: str,
    ) -> None:  # fmt: skip
        self.mode = optim.on_nonfinite
        self.limit = optim.max_skipped_steps
        self.trust = checkpoints.trust_checkpoint
        # What a rollback with no checkpoint to go back to yet should change
        period, minutes = checkpoints.checkpointing_period, checkpoints.checkpoint_minutes
        self.saves_hint = "set --checkpointing_period lower" if period else (
            "set --checkpointing_period, or --checkpoint_minutes lower" if minutes
            else "--checkpointing_period=0 saves at the end only: set a period")  # fmt: skip
        self.store = store
        self.grads_count = precision != "16-mixed"
        self.every = 1  # steps per read of the record (set at train start)
        self.on_cpu = True
        self.reduce_here = False  # the comm hook all-reduces itself (gloo), or allreduce_hook
        self.measured: MeasuredNorm | None = None
        self.epoch_loss: EpochLoss | None = None
        self.params: list[torch.nn.Parameter] = []
        self.zero: torch.Tensor | None = None  # on the module's device
        self.window: list[StepRecord] = []
        self.batches: list[tuple[int, int]] = []  # the current step's
        self.loss: torch.Tensor | None = None  # the current step's, summed over its batches
        # The sum of the current step's own gradient (all buckets, before reducing): finite or not
        self.grad_sum: torch.Tensor | None = None
        self.skipped = 0
        self.rollbacks = 0
        self.rollback_pending = False
        self.rollback_step = 0  # the step that a pending rollback undoes
        self.mean: float | None = None  # the loss's exponential mean (spikes)
        # (step, what) of each loss spike and non-finite step: marks on the loss curve
        self.events: list[tuple[int, str]] = []
        self.seen = 0

    # --- state carried in the checkpoint: --max_skipped_steps bounds a run across its resumes,
    # restarts and requeues (each one's fresh budget let a run that keeps turning NaN go on)
    def state_dict(self) -> dict[str, int]:
        return {"skipped": self.skipped, "rollbacks": self.rollbacks}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.skipped = int(state_dict.get("skipped", 0))
        self.rollbacks = int(state_dict.get("rollbacks", 0))

    # --- recording (device only) -----------------------------------------------------------
    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        device = pl_module.device
        self.on_cpu = device.type == "cpu"
        per_step = self.on_cpu or self.mode != "stop"
        box = getattr(pl_module, "step_grad_norm", None)  # the built-in model's clipping takes it
        self.measured = box if isinstance(box, MeasuredNorm) else None
        mean = getattr(pl_module, "epoch_loss", None)  # the built-in model's train/loss_epoch
        self.epoch_loss = mean if isinstance(mean, EpochLoss) else None
        self.every = 1 if per_step else max(1, trainer.log_every_n_steps)
        self.params = list(pl_module.parameters())
        self.zero = torch.zeros((), device=device)
        model = trainer.strategy.model
        if isinstance(model, DistributedDataParallel):
            group = model.process_group
            self.reduce_here = dist.get_backend(group) == "gloo"
            # Through a lambda: DDP compares a hook's annotations with its types, and ours are
            # strings here (`from __future__ import annotations`).
            model.register_comm_hook(group, lambda state, bucket: self._reduce(state, bucket))

    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self.batches.append((trainer.current_epoch, batch_idx))

    def on_before_backward(
        self, trainer: L.Trainer, pl_module: L.LightningModule, loss: torch.Tensor
    ) -> None:
        loss = loss.detach().float()
        self.loss = loss if self.loss is None else self.loss + loss

    def _reduce(
        self, group: dist.ProcessGroup, bucket: dist.GradBucket
    ) -> torch.futures.Future[torch.Tensor]:
        """DDP's all-reduce of one gradient bucket on DDP's `group`, after looking at this rank's
        own values."""
        gradients_ready()  # the step clock's start of the all-reduce wait (ae.forensics)
        buf = bucket.buffer()
        # One pass: a sum is non-finite exactly when an element is (NaN, +-Inf), unless finite
        # values overflow float32 (~3e38), where the reduced norm has overflowed long before.
        # `torch.isfinite(buf).all()` made five passes and four temporaries (abs, ne, eq, and,
        # all): ~0.45 ms a step of the 2-process trainer_overhead bench, its largest cost of ours.
        total = buf.sum(dtype=torch.float32)
        self.grad_sum = total if self.grad_sum is None else self.grad_sum + total
        if self.loss is not None and bucket.index() == 0:
            # A non-finite loss still reaches every rank: one NaN added to one bucket of the
            # step (the reduced gradient is then non-finite everywhere; one bucket is enough).
            # loss * 0 is 0 for a finite loss and NaN for NaN or +-Inf.
            buf[:1].add_((self.loss * 0).to(buf.dtype))
        if not self.reduce_here:
            return allreduce_hook(group, bucket)  # NCCL: its callback runs on this thread
        # gloo: reduced on this thread, the one that runs backward. `allreduce_hook`'s future
        # callback would run on gloo's thread, in a Python thread state made and freed each
        # step, and a DataLoader forking its workers meanwhile (validation's) can leave one
        # deadlocked at birth (docs/BENCHMARKS.md, straggler_soak). The price: on gloo, backward
        # waits for each bucket's all-reduce instead of overlapping the next buckets with it.
        dist.all_reduce(buf.div_(group.size()), group=group)
        reduced: torch.futures.Future[torch.Tensor] = torch.futures.Future()
        reduced.set_result(buf)
        return reduced

    def on_before_optimizer_step(
        self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: torch.optim.Optimizer
    ) -> None:
        assert self.zero is not None
        grads = [p.grad for p in self.params if p.grad is not None]
        norm = torch.nn.utils.get_total_norm(grads) if grads else self.zero
        if grads and self.measured is not None:  # the clipping's, measured once
            self.measured.value = norm
        loss = self.loss if self.loss is not None else self.zero
        values = (loss, norm, self.grad_sum)
        self.window.append(StepRecord(trainer.global_step + 1, self.batches, values))
        self.batches, self.loss, self.grad_sum = [], None, None
        if len(self.window) >= self.every:
            self._read(trainer, pl_module)

    # --- reading and acting (host) ---------------------------------------------------------
    def _read(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        window, self.window = self.window, []
        tensors = []
        for rec in window:
            assert rec.values is not None
            loss, norm, own_sum = rec.values
            # Without DDP (no comm hook) a rank's own gradient is the reduced one.
            tensors += [loss, norm, norm if own_sum is None else own_sum]
        if self.on_cpu:  # no sync to save: a value each, without building a stack (~10 us)
            flat = [t.item() for t in tensors]
        else:
            flat = torch.stack([t.float() for t in tensors]).tolist()  # the one read of the window
        for k, rec in enumerate(window):
            loss, norm, own_grad = flat[3 * k : 3 * k + 3]
            own = not math.isfinite(loss) or (self.grads_count and not math.isfinite(own_grad))
            reduced = self.grads_count and not math.isfinite(norm)
            if own or reduced:
                current = rec is window[-1]
                self._name(trainer, pl_module, rec, loss, own, current)
                self._act(trainer, pl_module, rec, current)
                return
            self._spike(trainer, rec, loss)

    def _name(
        self, trainer: L.Trainer, pl_module: L.LightningModule, rec: StepRecord, loss: float,
        own: bool, current: bool,
    ) -> None:  # fmt: skip
        log = main_log if trainer.is_global_zero else logger
        if not own:
            log.warning(NONFINITE_RECEIVED.format(step=rec.step))
            return
        if not math.isfinite(loss):
            value = f"loss={_value(loss)}"
        else:
            grads = [(n, p.grad) for n, p in pl_module.named_parameters() if p.grad is not None]
            where = nonfinite_in(grads) if current else None
            value = "gradient=nan" + (f" in {where}" if where else "")
        log.error(NONFINITE.format(value=value, **self._detail(trainer, rec)))

    def _detail(self, trainer: L.Trainer, rec: StepRecord) -> dict[str, Any]:
        """Where a step's value came from: rank, step, epoch, batch(es), shard and keys."""
        epoch, batch = rec.batches[-1] if rec.batches else (trainer.current_epoch, -1)
        batches = [b for e, b in rec.batches if e == epoch] or [batch]
        members: list[Member] = []
        stream = getattr(trainer.datamodule, "train_set", None)
        if isinstance(stream, ShardStream) and stream.epoch == epoch:
            for b in batches:
                members += batch_members(stream, b)
        samples = describe_members(members) if members else "samples unknown"
        return {
            "rank": trainer.global_rank, "step": rec.step, "epoch": epoch,
            "batch": ",".join(map(str, batches)), "samples": samples,
        }  # fmt: skip

    def _spike(self, trainer: L.Trainer, rec: StepRecord, loss: float) -> None:
        mean, self.seen = self.mean, self.seen + 1
        if mean is not None and self.seen > SPIKE_WARMUP and loss > SPIKE_FACTOR * mean > 0:
            ratio = f"{loss / mean:.1f}"
            detail = self._detail(trainer, rec)
            logger.warning(
                LOSS_SPIKE.format(loss=f"{loss:.6g}", ratio=ratio, mean=f"{mean:.6g}", **detail)
            )
            self.events.append((rec.step, "loss spike"))
            return  # the spike stays out of the mean it is judged against
        self.mean = loss if mean is None else SPIKE_DECAY * mean + (1 - SPIKE_DECAY) * loss

    def _act(
        self, trainer: L.Trainer, pl_module: L.LightningModule, rec: StepRecord, current: bool
    ) -> None:
        log = main_log if trainer.is_global_zero else logger
        for p in pl_module.parameters():  # whatever happens next, this step is not applied
            p.grad = None
        used = self.skipped + self.rollbacks
        self.events.append((rec.step, "non-finite"))
        if self.mode == "stop" or used >= self.limit or not current:
            log.error(
                NONFINITE_STOP.format(
                    step=rec.step, mode=self.mode, checkpoint=self.newest_checkpoint() or "none"
                )
            )
            done = "skipped" if self.mode == "skip" else "rolled back"
            why = "" if self.mode == "stop" else (
                f"; {used} of at most {self.limit} steps {done} already (--max_skipped_steps)"
            )  # fmt: skip
            # The same checkpoint, weights and batches meet it again: what to change to go on
            change = "--on_nonfinite=skip (or rollback)" if self.mode == "stop" else "a higher "
            change += "" if self.mode == "stop" else "--max_skipped_steps"
            raise NonFiniteError(
                f"non-finite value at step {rec.step} (--on_nonfinite={self.mode}{why}): the "
                "NONFINITE line names the rank and samples; `ae-diagnose` shows it\n"
                f"  To go on past it: --resume_from_checkpoint=last with {change}, or with its "
                "cause fixed (samples holding NaN/Inf, a learning rate too high)"
            )
        if self.epoch_loss is not None:  # a step not applied is no part of the epoch's mean
            self.epoch_loss.drop_step()
        if self.mode == "skip":
            self.skipped += 1
            log.warning(NONFINITE_SKIPPED.format(step=rec.step, skipped=self.skipped,
                                                 limit=self.limit))  # fmt: skip
            return
        self.rollbacks += 1
        self.rollback_pending = True
        self.rollback_step = rec.step

    def newest_checkpoint(self, before: int | None = None) -> Path | None:
        files = self.store.step_files(before)
        return files[-1] if files else None

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, idx: int
    ) -> None:
        if not self.rollback_pending:
            return
        self.rollback_pending = False
        # The newest checkpoint of a step before the bad one, the same file on every rank: rank 0
        # may already be writing this step's own checkpoint while a slower rank looks (seen: rank
        # 1 went back to step 6's, rank 0 to step 4's).
        path = self.newest_checkpoint(before=self.rollback_step)
        if path is None:
            raise NonFiniteError(
                f"non-finite value at step {trainer.global_step}: --on_nonfinite=rollback has no "
                f"checkpoint to go back to yet ({self.saves_hint})"
            )
        ckpt = checkpoint_read.load(path, trust=self.trust, map_location=pl_module.device)
        pl_module.load_state_dict(ckpt["state_dict"])
        for opt, state in zip(trainer.optimizers, ckpt["optimizer_states"], strict=True):
            opt.load_state_dict(state)
        for cb in trainer.callbacks:
            if isinstance(cb, EMA):  # its average, and the live weights it saved aside
                cb.on_load_checkpoint(trainer, pl_module, ckpt)
        to, step = ckpt["global_step"], trainer.global_step
        log = main_log if trainer.is_global_zero else logger
        log.warning(
            ROLLBACK.format(step=step, path=path, to=to, count=self.rollbacks,
                            limit=self.limit)
        )  # fmt: skip

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.is_global_zero and (self.skipped or self.rollbacks):
            main_log.warning(
                NONFINITE_SUMMARY.format(
                    skipped=self.skipped, rollbacks=self.rollbacks, mode=self.mode
                )
            )
