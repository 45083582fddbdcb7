"""The LightningModule that trains an autoencoder: any network of `ae.training.models`, `--loss`,
an optional VAE bottleneck (`--kl_weight`), validation quality metrics, AdamW with per-module LR.

`build_model` is the one entry point: it resolves `--model` (`auto` picks `mlp` for vectors and
`conv` for images), builds the network, checks on a real batch that `encode` and `decode` return
tensors, that `decode(encode(x))` has the shape of `x` and that the loss and validation metrics
compute on it, that a user network's loss terms do not take the names of ae's own series, and,
for several processes, that every parameter gets a gradient (or --find_unused_parameters is on);
a mistake is a `ModelError` before training starts, not a traceback mid-step or in the first
validation (the rules: `ae.training.model_check`). It returns the `AutoEncoder`, or the user's
own LightningModule.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict
from typing import Any

import lightning as L
import torch
from torch import nn
from torch.nn import functional as F

from ae.config import ModelConfig, ObjectiveConfig, OptimConfig
from ae.data.datamodule import ShardDataModule
from ae.data.decoding.decode import InputSpec
from ae.data.stream.shard_stream import ShardStream
from ae.forensics.faults import fault_point, loss_poison
from ae.log_lines import main_log
from ae.training.epoch_loss import CHECKPOINT_KEY, EpochLoss
from ae.training.inception import FEATURES
from ae.training.lr import (
    DiscSchedule,
    Schedule,
    at_schedule_step,
    disc_start_note,
    lr_rescaled_line,
    rescale,
    scale_lr,
    schedule_line,
    steps_to_end,
)
from ae.training.model_check import (
    user_loss,
)
from ae.training.models.builtin import builtin_networks, kl_divergence, resolve_name
from ae.training.objective import Parts, Recipe, check_recipe, discriminator_for, last_layer_of
from ae.training.optimizer import MeasuredNorm, clip_groups, generator_groups, param_groups
from ae.training.perceptual import LPIPS, SharedNet
from ae.training.position.checkpoint_read import spec_record
from ae.training.quality import QualityMetrics

LOSSES = {"mse": F.mse_loss, "l1": F.l1_loss, "smooth_l1": F.smooth_l1_loss}


class AutoEncoder(L.LightningModule):
    """A built-in network (`encoder`, `decoder`), or a user nn.Module (`net`) with encode/decode."""

    def __init__(
        self,
        spec: InputSpec,
        model: ModelConfig | None = None,
        optim: OptimConfig | None = None,
        world_size: int = 1,
        net: nn.Module | None = None,
        objective: ObjectiveConfig | None = None,
    ) -> None:
        super().__init__()
        model = model or ModelConfig()
        optim = optim or OptimConfig()
        objective = objective or ObjectiveConfig()
        check_recipe(objective, spec.kind, spec.shape)
        self.save_hyperparameters(
            {
                "spec": spec_record(spec),  # a plain dict: the safe loader reads it
                **asdict(model),
                "model": resolve_name(model.model, spec),
                "learning_rate": scale_lr(optim.learning_rate, world_size, optim.lr_scale),
                "weight_decay": optim.weight_decay,
                "warmup_steps": optim.warmup_steps,
                "lr_scheduler": optim.lr_scheduler,
                "encoder_lr_mult": optim.encoder_lr_mult,
                "decoder_lr_mult": optim.decoder_lr_mult,
                **asdict(objective),
                "disc_learning_rate": scale_lr(
                    objective.disc_lr or optim.learning_rate, world_size, optim.lr_scale
                ),
            }
        )
        self.net = net
        self._scaled_for = (world_size, optim.lr_scale)  # the ranks the LR is scaled for
        if net is None:
            self.encoder, self.decoder = builtin_networks(spec, model)
        # The latent-diffusion recipe: LPIPS comes later (`attach_perceptual`), in training only.
        self.recipe = Recipe(objective)
        self.discriminator = None
        if objective.disc_weight > 0:
            self.adaptive_layer()  # a user model without a last layer: a ModelError now
            self.discriminator = discriminator_for(objective, spec.shape)
        self.kl_weight = model.kl_weight
        self.recon_loss = LOSSES[model.loss]
        self.quality = QualityMetrics(spec)
        self._compile = model.compile
        self.epoch_loss = EpochLoss()  # the guard drops the steps it does not apply
        self.step_grad_norm = MeasuredNorm()  # filled by the non-finite guard, for the clipping

    # --- the network ----------------------------------------------------------------------
    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """The latent of `x`: a VAE's mean (what downstream users of the latents want)."""
        if self.net is not None:
            return self.net.encode(x)
        z = self.encoder(x)
        return z.chunk(2, dim=1)[0] if self.kl_weight > 0 else z

    def decode(self, z: torch.Tensor) -> torch.Tensor:
        return self.net.decode(z) if self.net is not None else self.decoder(z)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.decode(self.encode(x))

    def adaptive_layer(self) -> nn.Parameter:
        """The decoder's last layer: where the adaptive weight compares the gradients."""
        return last_layer_of(self.net if self.net is not None else self)

    def attach_perceptual(self, lpips: LPIPS) -> None:
        """LPIPS for the perceptual term and `val/lpips`: beside the module, not in it."""
        self.recipe.lpips = SharedNet(lpips)
        self.quality.attach_lpips(self.recipe.lpips)

    def attach_fid(self, inception: nn.Module, features: int = FEATURES) -> None:
        """The FID Inception (`features` per image) for `val/rfid`: beside the module, not in
        it."""
        self.quality.attach_fid(SharedNet(inception), features)

    def _step(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None, dict]:
        """(loss, reconstruction or None, {name: extra loss term}) of one batch."""
        parts = self.recipe.perceptual(self._parts(x), x)
        return parts.loss(), parts.recon, parts.logs

    def _parts(self, x: torch.Tensor) -> Parts:
        """The batch's loss terms (`Parts`), before the recipe's; a reconstruction also from a
        user model with its own loss when the recipe needs one."""
        if self.net is not None and callable(getattr(self.net, "loss", None)):
            loss, logs = user_loss(self.net.loss(x))
            need = self.recipe.lpips is not None or self.discriminator is not None
            recon = self(x) if need else None
            return Parts(recon, None, loss, dict(logs or {}), rest_is_reconstruction=True)
        if self.net is not None or self.kl_weight == 0:
            recon = self(x)
            return Parts(recon, self.recon_loss(recon, x), None)
        mean, logvar = self.encoder(x).chunk(2, dim=1)
        logvar = logvar.clamp(-30.0, 20.0)  # exp() stays finite
        # The reparameterised sample while training; the mean when evaluating (deterministic).
        z = mean + torch.randn_like(mean) * (0.5 * logvar).exp() if self.training else mean
        recon = self.decoder(z)
        rec, kl = self.recon_loss(recon, x), kl_divergence(mean, logvar)
        return Parts(recon, rec, self.kl_weight * kl, {"recon": rec, "kl": kl})

    def setup(self, stage: str) -> None:
        # After the callbacks' setup: the EMA copy (made there) stays a plain module.
        if self._compile:
            self._compile = False  # once, however often fit/validate call setup
            if self.net is not None:
                self.net.encode = torch.compile(self.net.encode)
                self.net.decode = torch.compile(self.net.decode)
            else:  # in place: the state dict keeps its keys
                self.encoder.compile()
                self.decoder.compile()

    # --- training and validation -----------------------------------------------------------
    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        fault_point("train", self.global_step)
        # `self.log` costs ~0.3 ms a call (Lightning moves its metric state each time), as much
        # as a whole step of a small model: the step loss is logged at the loggers' cadence, and
        # the epoch mean is summed here and logged once, after the epoch's last step.
        trainer = self.trainer
        # Lightning hands step metrics to the loggers after the steps where
        # (optimizer steps so far + 1) % log_every_n_steps == 0: log at exactly those, or the
        # values are dropped before any logger sees them.
        on_cadence = (self.global_step + 1) % trainer.log_every_n_steps == 0
        d = self.discriminator
        terms = self.recipe.training(
            self._parts(batch), batch, d, self.adaptive_layer() if d is not None else None,
            self.global_step, with_stats=on_cadence,
        )  # fmt: skip
        loss, logs, backward = terms.loss, terms.logs, terms.backward
        if (poison := loss_poison(self.global_step)) is not None:  # AE_FAULT=nan@train: tests
            loss, backward = loss * poison, backward * poison  # what backward gets, and logged
        if terms.stats is not None:  # this rank's own, in its log: no collective
            self.recipe.report(self.global_step, self.global_rank, terms.stats)
        if on_cadence:
            # rank 0's own loss: a sync across ranks would cost a collective per step. On the
            # progress bar only when there is one: Lightning turns a prog_bar value into a
            # Python number after every batch, a host sync per step on a GPU (bench/gpu_proof).
            self.log("train/loss", loss, prog_bar=trainer.progress_bar_callback is not None)
            for name, value in logs.items():
                self.log(f"train/{name}", value)
        if batch_idx == 0:
            self.epoch_loss.start()
        self.epoch_loss.add(loss, self.global_step)
        return backward

    def on_train_batch_end(self, outputs: object, batch: torch.Tensor, batch_idx: int) -> None:
        # After the optimizer step, not in training_step: the non-finite guard has decided by
        # then whether the epoch's last step counts.
        trainer = self.trainer
        if not (trainer.is_last_batch or 0 < trainer.max_steps <= self.global_step):
            return
        if (share := self.epoch_loss.share(self.device)) is not None:
            # Epoch mean over all ranks, each rank's weighted by its batches (one of them holds
            # those before a resume): Lightning's sync of a mean, once per epoch.
            mean, count = share
            self.log("train/loss_epoch", mean, on_step=False, on_epoch=True, sync_dist=True,
                     batch_size=count)  # fmt: skip

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        # Every rank dumps each save (ae's saves are collective): the epoch's sum so far is
        # reduced over the ranks here, so that a resume mid-epoch has the whole epoch's mean.
        trainer = self.trainer
        checkpoint[CHECKPOINT_KEY] = self.epoch_loss.state_dict(
            trainer.global_step, lambda t: trainer.strategy.reduce(t, reduce_op="sum"), self.device
        )

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        # Every rank loads the checkpoint; rank 0 alone counts the epoch before it. (A rollback
        # loads only the state dict: the epoch's sum goes on as this process has it.)
        self.epoch_loss.load_state_dict(checkpoint.get(CHECKPOINT_KEY), self.global_rank == 0)

    def evaluate(
        self, batch: torch.Tensor, quality: QualityMetrics | None
    ) -> tuple[torch.Tensor, dict]:
        """What validation computes on a batch: (loss, {name: extra loss term}), the quality
        metrics updated (if given). Also the model check before training (`latent_shape`), on
        a real batch."""
        loss, recon, logs = self._step(batch)
        if quality is not None:
            quality.update(self(batch) if recon is None else recon, batch)
        return loss, logs

    def validation_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        # Each validation sample counts once: the repeats that fill a batch in pad mode (the
        # batch's last ones) are left out of the loss and the metrics. A batch of nothing but
        # repeats (a rank past the end of a small split) is still evaluated, at weight 0: every
        # rank logs the same names, whose epoch values are reduced together.
        kept = len(batch) - self._repeats(batch_idx)
        loss, logs = self.evaluate(batch[:kept] if kept else batch, self.quality if kept else None)
        self.log("val/loss", loss, prog_bar=True, sync_dist=True, batch_size=kept)
        for name, value in logs.items():
            self.log(f"val/{name}", value, sync_dist=True, batch_size=kept)
        self.quality.log_to(self)
        return loss

    def _repeats(self, batch_idx: int) -> int:
        """How many of validation batch `batch_idx` repeat a sample (ae's pad-mode streams)."""
        try:
            stream = getattr(self.trainer.datamodule, "val_set", None)
        except RuntimeError:  # not attached to a Trainer (a validation step called directly)
            return 0
        return stream.repeats_in(batch_idx) if isinstance(stream, ShardStream) else 0

    # --- optimizer -------------------------------------------------------------------------
    def _param_groups(self) -> list[tuple[str, list[nn.Parameter], float]]:
        hp = self.hparams
        d = self.discriminator
        not_d = {id(p) for p in d.parameters()} if d is not None else set()
        return generator_groups(
            [p for p in self.parameters() if id(p) not in not_d],
            self.net if self.net is not None else self,
            (hp.encoder_lr_mult, hp.decoder_lr_mult),
        )

    def configure_optimizers(self) -> dict:
        """AdamW with one parameter group per module (`--encoder_lr_mult`, `--decoder_lr_mult`),
        and the warmup + decay schedule applied to all, stepped once per optimizer step."""
        hp = self.hparams
        groups = [
            {"params": params, "lr": hp.learning_rate * mult, "name": name}
            for name, params, mult in self._param_groups()
        ]
        n_generator = len(groups)
        groups = param_groups(groups, self.discriminator, hp.disc_learning_rate)
        opt = torch.optim.AdamW(groups, lr=hp.learning_rate, weight_decay=hp.weight_decay)
        total = int(self.trainer.estimated_stepping_batches)
        if self.trainer.is_global_zero and self.trainer.ckpt_path is None:
            # On resume this is an estimate before the loops are restored: `replan_schedule`.
            main_log.info(schedule_line(hp.warmup_steps, total, hp.lr_scheduler))
            if self.discriminator is not None and (note := disc_start_note(hp.disc_start, total)):
                main_log.info(note)
        schedule = Schedule(hp.warmup_steps, total, hp.lr_scheduler)
        schedules: list[Schedule] = [schedule] * n_generator
        if self.discriminator is not None:
            schedules.append(DiscSchedule(hp.warmup_steps, total, hp.lr_scheduler, hp.disc_start))
        sched = torch.optim.lr_scheduler.LambdaLR(opt, schedules)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    def replan_schedule(self) -> str:
        """On resume: the schedule runs from the step reached to the end of this run, which other
        settings (batch size, world size, max_epochs, ...) move. Returns what was done, or ""."""
        trainer = self.trainer
        dm = trainer.datamodule
        lambdas = getattr(self.lr_schedulers(), "lr_lambdas", [None])
        schedule = lambdas[0]
        if not isinstance(schedule, Schedule):
            return ""
        step = trainer.global_step
        end = math.inf
        if trainer.max_epochs not in (None, -1) and isinstance(dm, ShardDataModule):
            done, epoch_len, full_len = dm.epoch_lengths()
            end = step + steps_to_end(
                done=done, epoch_len=epoch_len, full_len=full_len,
                epoch=trainer.current_epoch, max_epochs=trainer.max_epochs,
                accumulation=trainer.accumulate_grad_batches,
            )  # fmt: skip
        if trainer.max_steps != -1:
            end = min(end, trainer.max_steps)
        if end == math.inf or end == schedule.total_steps:
            return ""
        old = schedule.total_steps
        for each in lambdas:  # the discriminator's too
            if isinstance(each, Schedule):
                each.total_steps = int(end)
        # The LR the checkpoint carried is the old plan's: the next step takes the new plan's
        at_schedule_step(trainer.optimizers[0], self.lr_schedulers())
        if trainer.is_global_zero:
            main_log.info(
                f"LR schedule re-planned at step {step}: {old} -> {int(end)} optimizer steps in "
                "all (the LR reaches the schedule's end at the last step)"
            )
        return f"re-planned the LR schedule from {old} to {int(end)} steps"

    def rescale_lr(self, flags: Sequence[str] = ()) -> str:
        """On resume on another number of ranks (a job that lost or gained a node), or with
        other LR `flags` (their names, as changed since the checkpoint): the LR of these flags,
        scaled for this run's ranks, the schedule going on at its step. Returns what was done,
        or ""."""
        hp = self.hparams
        targets = [hp.learning_rate * mult for _, _, mult in self._param_groups()]
        if self.discriminator is not None:
            targets.append(hp.disc_learning_rate)
        done = rescale(self.trainer.optimizers[0], self.lr_schedulers(), targets)
        if done is None:
            return ""
        world, mode = self._scaled_for
        if self.trainer.is_global_zero:
            main_log.info(lr_rescaled_line(world, self.trainer.global_step, *done, mode, flags))
        if flags:  # was "re-scaled the LR for 2 ranks" of a run on the same 2 ranks
            return f"set the LR from the new {', '.join(f'--{f}' for f in flags)}"
        return f"re-scaled the LR for {world} ranks"

    def configure_gradient_clipping(
        self,
        optimizer: torch.optim.Optimizer,
        gradient_clip_val: float | None = None,
        gradient_clip_algorithm: str | None = None,
    ) -> None:
        measured = self.step_grad_norm
        norm, measured.value = measured.value, None
        if self.discriminator is not None and gradient_clip_val:
            clip_groups(optimizer, gradient_clip_val)
        elif norm is not None and gradient_clip_val and gradient_clip_algorithm in (None, "norm"):
            # What Lightning's clip_grad_norm_ does (over the optimizer's parameters), with the
            # norm the guard measured over the same gradients (without a discriminator the
            # optimizer holds every parameter).
            params = [p for group in optimizer.param_groups for p in group["params"]]
            torch.nn.utils.clip_grads_with_norm_(params, gradient_clip_val, norm)
        else:
            super().configure_gradient_clipping(
                optimizer, gradient_clip_val, gradient_clip_algorithm
            )
