"""When checkpoints are saved during training, and what goes into them.

- every `--checkpointing_period` optimizer steps, at the first step `--checkpoint_minutes` after
  the previous save, after the last step of training, and on preemption
  (`ae.training.preemption`): a step checkpoint, which `last.ckpt` then points at (these are
  taken at the step boundary, `ae.training.step_boundary`);
- after a validation that lowers the val loss: `best.ckpt` (`--save_best`).
Files, atomicity and retention are `ae.training.checkpoint_files`. Each checkpoint also carries the
resolved config (`ae_config`), so a checkpoint says how it was trained.

All step checkpoints are saved at the end of a training batch: that is the state Lightning
resumes exactly (a state saved once the fit loop has finished resumes into an empty epoch).
Lightning's `trainer.save_checkpoint` is collective under DDP (every rank dumps its state, rank 0
writes, all meet at a barrier), so every decision to save is taken identically on all ranks: step
counts are equal on every rank, and the best-loss decision is rank 0's, broadcast. The clocks of
the ranks are not: whether any rank found the `--checkpoint_minutes` time up travels in the step
vote (`ae.training.step_vote`, about four times a second, off the training process group), so every
rank takes the timed save at the same step.
"""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
from loguru import logger

from ae import atomic_files
from ae.atomic_files import human_size
from ae.config import CheckpointConfig
from ae.forensics.faults import fault_point
from ae.forensics.progress import in_phase, progress
from ae.log_lines import (
    BEST_SAVE,
    CHECKPOINT_END,
    CHECKPOINT_REFUSED,
    CHECKPOINT_START,
    RESUMED,
    VAL_NONFINITE,
    main_log,
)
from ae.run_paths import RunDir
from ae.training.checkpoint_files import CheckpointStore
from ae.training.model import AutoEncoder
from ae.training.model_check import not_logged
from ae.training.nonfinite import nonfinite_in, training_state
from ae.training.position import checkpoint_read
from ae.training.position.sync import PositionSync

# Keys whose change between a checkpoint and the resumed run is expected, not news.
_UNREMARKABLE = {"config", "print_config", "resume_from_checkpoint", "overwrite"}
# The flags that set the LR (with the world size): a change re-sets it on resume.
LR_FLAGS = ("learning_rate", "lr_scale", "encoder_lr_mult", "decoder_lr_mult", "disc_lr")


def no_val_loss(logged: list[str]) -> str:
    """The warning for a validation that logged no `val/loss` (what best.ckpt minimises)."""
    calls = (
        'it with self.log("val/loss", loss, sync_dist=True) in validation_step, or pass '
        "--save_best=false"
    )
    return not_logged("No best.ckpt", "val/loss in validation", logged, calls)


class AtomicCheckpointIO(TorchCheckpointIO):
    """Lightning's torch.save writer, but through a tmp file + fsync + rename; and ae's safe
    reader (`ae.training.position.checkpoint_read`): `weights_only=False` (`--trust_checkpoint`)
    is the only way to run code from the file."""

    def save_checkpoint(
        self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None
    ) -> None:
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__} takes no storage_options")
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)

        def write(f: Any) -> None:
            torch.save(checkpoint, f)
            fault_point("checkpoint", progress.step)  # tests: a kill here is a kill mid-save

        atomic_files.write(path, write, what="checkpoint")

    def load_checkpoint(
        self, path: Any, map_location: Any = "cpu", weights_only: bool | None = None
    ) -> dict[str, Any]:
        return checkpoint_read.read(path, trust=weights_only is False, map_location=map_location)


def changed_settings(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    """`key old -> new` for each setting that differs from the checkpoint's."""
    return [
        f"{k} {old[k]!r} -> {new[k]!r}"
        for k in new
        if k in old and old[k] != new[k] and k not in _UNREMARKABLE
    ]


def _last_step_of_training(trainer: L.Trainer, batch_idx: int, step: int) -> bool:
    """Optimizer step `step`, ending batch `batch_idx`, is the run's last. Asked after every
    step: the cheap tests first (each of the trainer's properties is a few Python calls)."""
    if 0 <= trainer.max_steps <= step:  # -1: no limit
        return True
    if batch_idx + 1 < trainer.num_training_batches:
        return False
    return trainer.max_epochs not in (None, -1) and trainer.current_epoch + 1 >= trainer.max_epochs


def current_lr(trainer: L.Trainer) -> float:
    return trainer.optimizers[0].param_groups[0]["lr"] if trainer.optimizers else float("nan")


class Checkpointing(L.Callback):
    def __init__(
        self, cfg: CheckpointConfig, run_dir: RunDir, settings: dict[str, Any], config_yaml: str
    ) -> None:
        """`settings`: the run's whole flat config, recorded in every checkpoint; `config_yaml`:
        the same as a --config file, written to `<output_dir>/config.yaml` once training starts."""
        self.cfg = cfg
        self.settings = settings
        self.config_yaml = config_yaml
        self.config_file = run_dir.config_yaml
        self.store = CheckpointStore(run_dir.checkpoints, cfg.checkpoints_total_limit)
        self.best_loss = math.inf
        self.best_step = -1
        self.saved_step = -1  # step of the newest step checkpoint of this run
        self.clock = time.monotonic
        self.saved_at = self.clock()  # of the newest step checkpoint, or of the train start
        self._resumed_from: dict[str, Any] | None = None
        self._changed: list[str] = []
        self._lr_flags: list[str] = []  # the LR flags changed since the checkpoint
        self._val_nonfinite_said = False
        self._no_val_loss_said = False

    # --- state carried in the checkpoint ----------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {"best_loss": self.best_loss, "best_step": self.best_step}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.best_loss = state_dict.get("best_loss", math.inf)
        self.best_step = state_dict.get("best_step", -1)

    def on_save_checkpoint(
        self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        checkpoint["ae_config"] = self.settings

    def on_load_checkpoint(
        self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        self._resumed_from = {"step": checkpoint["global_step"], "epoch": checkpoint["epoch"]}
        saved = checkpoint.get("ae_config", {})
        self._changed = changed_settings(saved, self.settings)
        self._lr_flags = [k for k in LR_FLAGS if k in saved and saved[k] != self.settings.get(k)]

    # --- when to save -----------------------------------------------------------------------
    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if trainer.is_global_zero:
            self.store.prepare()

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.saved_at = self.clock()
        if trainer.is_global_zero:
            # Only now, the model built and any checkpoint restored: an attempt that fails
            # before it trains (a damaged checkpoint, another model) leaves the config of the run
            # that did train in place, for the next --config. Written whole or not at all.
            atomic_files.write(self.config_file, self.config_yaml.encode(), what="config")
        if self._resumed_from is None:
            return
        ckpt = trainer.ckpt_path
        if trainer.is_global_zero and ckpt and (note := self.store.resumed_from(Path(ckpt))):
            main_log.info(note)
        # What ae did about the changes (the data module re-split the epoch's rest on restore;
        # the LR schedule is re-planned now, the loops being restored).
        resumed = getattr(trainer.datamodule, "resumed", None)
        actions = [
            resumed.note if resumed is not None else "",
            pl_module.replan_schedule() if isinstance(pl_module, AutoEncoder) else "",
            pl_module.rescale_lr(self._lr_flags) if isinstance(pl_module, AutoEncoder) else "",
        ]
        actions = [a for a in actions if a]
        if (self._changed or actions) and trainer.is_global_zero:
            main_log.info(
                "Settings changed since the checkpoint: "
                + (", ".join(self._changed) or "none")
                + ("; " + "; ".join(actions) if actions else "")
            )
        if trainer.is_global_zero:
            sync = next((c for c in trainer.callbacks if isinstance(c, PositionSync)), None)
            at = sync.resumed if sync is not None else None
            main_log.info(
                RESUMED.format(
                    path=trainer.ckpt_path,
                    step=trainer.global_step,
                    epoch=trainer.current_epoch,
                    lr=f"{current_lr(trainer):.8g}",
                    batch=at.batch if at else 0,
                    batches=at.length if at else trainer.num_training_batches,
                    samples=at.samples if at else 0,
                )
            )

    def timed_save_due(self) -> bool:
        """This rank's `--checkpoint_minutes` clock has run out (the ranks agree on the save
        through `ae.training.step_vote`: it is collective)."""
        minutes = self.cfg.checkpoint_minutes
        return bool(minutes) and self.clock() - self.saved_at >= minutes * 60

    def after_step(self, trainer: L.Trainer, idx: int, step: int, timed: bool = False) -> None:
        """After optimizer step `step` (`trainer.global_step`), ending batch `idx`
        (`StepBoundary`); `timed`: the ranks agreed that a timed save is due (any rank's clock
        decides)."""
        period = self.cfg.checkpointing_period
        if period and step % period == 0:
            self.save_step(trainer, "periodic")
        if self.saved_step != step and timed:
            self.save_step(trainer, "timed")
        if self.saved_step != step and _last_step_of_training(trainer, idx, step):
            self.save_step(trainer, "final")

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.sanity_checking:
            return
        loss = trainer.callback_metrics.get("val/loss")
        value = float(loss) if loss is not None else math.inf
        if loss is None and self.cfg.save_best and not self._no_val_loss_said:
            # A LightningModule of the user's that logs `val_loss` (Lightning's habit), or none:
            # no best.ckpt would ever be saved, and nothing said so
            self._no_val_loss_said = True
            if trainer.is_global_zero:
                main_log.warning(no_val_loss(list(trainer.callback_metrics)))
        if loss is not None and not math.isfinite(value) and not self._val_nonfinite_said:
            # Training goes on (its own loss is guarded), but every validation metric and the
            # choice of best.ckpt are lost while it lasts: said once, not each epoch
            self._val_nonfinite_said = True
            if trainer.is_global_zero:
                main_log.warning(VAL_NONFINITE.format(
                    step=trainer.global_step, value=value,
                    best="; best.ckpt is not saved from it" if self.cfg.save_best else "",
                ))  # fmt: skip
        if not self.cfg.save_best:
            return
        # val/loss is synced across ranks, but the save below is collective: one decision.
        if not trainer.strategy.broadcast(value < self.best_loss, src=0):
            return
        if self._save(trainer, self.store.best, BEST_SAVE.format(value=value)):
            self.best_loss, self.best_step = value, trainer.global_step

    # --- saving -----------------------------------------------------------------------------
    def save_step(self, trainer: L.Trainer, reason: str) -> Path:
        """Save the training state as a step checkpoint and point `last` at it (all ranks).
        A state with a non-finite value is not saved: `last` stays the newest finite one."""
        path = self.store.step_path(trainer.global_step)
        if not self._save(trainer, path, reason):
            return self.store.last
        self.saved_step, self.saved_at = trainer.global_step, self.clock()
        if trainer.is_global_zero:
            for old in self.store.commit_step(path):
                logger.info(f"Removed {old.name} (keeping {self.store.keep} step checkpoints)")
        return path

    def _save(self, trainer: L.Trainer, path: Path, reason: str) -> bool:
        """Whether it saved. The guard first: the weights and optimizer state are the same on
        every rank, so every rank refuses the same save, without a collective."""
        step = trainer.global_step
        log = main_log if trainer.is_global_zero else logger
        bad = nonfinite_in(training_state(trainer, trainer.lightning_module))
        if bad is not None:
            log.error(CHECKPOINT_REFUSED.format(step=step, reason=reason, what=bad))
            return False
        with in_phase("checkpoint save"):
            # START stays off the console (END says it all there); both are in the files.
            log.bind(console=False).info(
                CHECKPOINT_START.format(step=step, reason=reason, path=path)
            )
            t0 = time.perf_counter()
            # Collective: all ranks dump, rank 0 writes, all meet at a barrier. The full state
            # (optimizer, loops, data position), not only the weights.
            trainer.save_checkpoint(path, weights_only=False)
            seconds = f"{time.perf_counter() - t0:.2f}"
            size = human_size(path.stat().st_size) if trainer.is_global_zero else "by rank 0"
            log.info(
                CHECKPOINT_END.format(
                    step=step, reason=reason, path=path, size=size, seconds=seconds
                )
            )
        return True
