"""What a batch costs with the latent-diffusion recipe (`--perceptual_weight`, `--disc_weight`):
the terms the `AutoEncoder` adds to its own loss, what is backpropagated, and what each rank
reports of the game.

One optimizer, one backward per batch (not Lightning's manual optimization, which would count
two optimizer steps per batch and refuse clipping and accumulation): the discriminator is a
parameter group of the one AdamW (`param_groups`), and the backward is of

    surrogate(x_hat, dL_G/dx_hat) + (the terms that do not pass through x_hat) + d_loss

with dL_G/dx_hat from `generator_gradient` (pixel + perceptual + adaptive weight x adversarial,
each loss backpropagated to x_hat once), the discriminator's hinge loss on a detached x_hat
(it trains the discriminator only) and D(x_hat) in the generator's term giving the
discriminator no gradient. Before `--disc_start` the adversarial part does not run; the
discriminator's parameters get a zero-valued term, so DDP (`find_unused_parameters=False`) sees
them used, and their LR factor is 0 (`DiscSchedule`).

The loss logged as `train/loss` and `val/loss` is what the model's reconstruction costs: pixel
(+ perceptual) (+ KL), or a user model's own loss (+ perceptual); `train/g_loss`, `train/d_loss`,
`train/d_weight` and the discriminator's logits and accuracy beside it. Per rank, on the
loggers' cadence: a GAN_STATS line in its log, its watch's GAN_WARNING lines
(`ae.training.adversarial.GanWatch`), and the same figures in its GAN_STATS_FILE, which rank 0
reads into the loggers (`ae.training.rank_series`): no collective.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from loguru import logger
from torch import nn

from ae import atomic_files
from ae.config import ObjectiveConfig
from ae.config.weight_files import resolve
from ae.log_lines import GAN_STATS, main_log
from ae.training.adversarial import (
    GanStats,
    GanWatch,
    NLayerDiscriminator,
    generator_gradient,
    hinge_d_loss,
    surrogate,
)
from ae.training.models import ModelError
from ae.training.perceptual import LPIPS, TAPS, SharedNet, load_lpips

# LPIPS reads VGG16's relu5_3, after 4 max pools: smaller images have no pixel left there.
MIN_LPIPS_SIZE = 2 ** (len(TAPS) - 1)


@dataclass
class Parts:
    """One batch's loss, split by how it reaches the parameters. `through`: the terms that do so
    through `recon` alone (pixel, perceptual); `rest`: the others (a VAE's KL, a user model's own
    loss); `rest_is_reconstruction`: whether `rest` counts in the adaptive weight's numerator
    (a user's loss does, taming's KL does not)."""

    recon: torch.Tensor | None
    through: torch.Tensor | None
    rest: torch.Tensor | None
    logs: dict[str, torch.Tensor] = field(default_factory=dict)
    rest_is_reconstruction: bool = False

    def loss(self) -> torch.Tensor:
        terms = [t for t in (self.through, self.rest) if t is not None]
        return terms[0] if len(terms) == 1 else terms[0] + terms[1]


@dataclass
class Terms:
    """`loss`: what is logged; `backward`: what Lightning backpropagates; `stats`: this rank's
    view of the game, on the cadence once the discriminator runs."""

    loss: torch.Tensor
    backward: torch.Tensor
    logs: dict[str, torch.Tensor]
    stats: GanStats | None = None


def discriminator_for(cfg: ObjectiveConfig, shape: tuple[int, ...]) -> NLayerDiscriminator:
    """The PatchGAN of `--disc_layers`/`--disc_channels` for images of `shape` (C, H, W)."""
    smallest = 3 * 2**cfg.disc_layers  # each stride-2 stage halves, the two last convs take 1 px
    if min(shape[1:]) < smallest:
        raise ModelError(
            f"disc_layers: a {cfg.disc_layers}-layer discriminator needs images of at least "
            f"{smallest} px; these are {shape[1]}x{shape[2]} (fewer --disc_layers, or a larger "
            "--image_size)"
        )
    return NLayerDiscriminator(shape[0], cfg.disc_channels, cfg.disc_layers)


def check_recipe(cfg: ObjectiveConfig, kind: str, shape: tuple[int, ...]) -> None:
    """The recipe's terms are for images of 1 or 3 channels, large enough for LPIPS."""
    if cfg.perceptual_weight == 0 and cfg.disc_weight == 0:
        return
    flag = "perceptual_weight" if cfg.perceptual_weight > 0 else "disc_weight"
    if kind != "image":
        raise ModelError(f"{flag}: the perceptual and adversarial terms are for images")
    if cfg.perceptual_weight > 0 and shape[0] not in (1, 3):
        raise ModelError(f"perceptual_weight: LPIPS takes 1 or 3 channels; these have {shape[0]}")
    if cfg.perceptual_weight > 0 and min(shape[1:]) < MIN_LPIPS_SIZE:
        raise ModelError(
            f"perceptual_weight: LPIPS needs images of at least {MIN_LPIPS_SIZE} px; these are "
            f"{shape[1]}x{shape[2]}"
        )


def last_layer_of(owner: nn.Module) -> nn.Parameter:
    """The decoder's last layer, where the adaptive weight compares the gradients: a user
    model's `last_layer()` if it has one, else the last weight (2 or more dimensions) of its
    `decoder` submodule (the built-in models' output conv)."""
    if callable(getattr(owner, "last_layer", None)):
        return owner.last_layer()
    decoder = getattr(owner, "decoder", None)
    weights = [p for p in decoder.parameters() if p.ndim >= 2] if decoder is not None else []
    if not isinstance(decoder, nn.Module) or not weights:
        raise ModelError(
            "disc_weight: the adaptive weight needs the decoder's last layer: give your class a "
            "last_layer() method returning that parameter, or a `decoder` submodule"
        )
    return weights[-1]


class Recipe:
    """The perceptual and adversarial terms; the discriminator itself is a submodule of the
    `AutoEncoder` (its state dict, the EMA, DDP, checkpoints), LPIPS is not (`SharedNet`)."""

    def __init__(self, cfg: ObjectiveConfig) -> None:
        self.cfg = cfg
        self.lpips: SharedNet | None = None
        self.watch = GanWatch(cfg.disc_weight)
        self.stats_file: Path | None = None

    def perceptual(self, parts: Parts, x: torch.Tensor) -> Parts:
        """`parts` with LPIPS (per sample, averaged over the batch) x `--perceptual_weight`
        added to its terms through `recon` (logged as `perceptual`, unweighted)."""
        if self.lpips is None or self.cfg.perceptual_weight == 0 or parts.recon is None:
            return parts
        p = self.lpips(parts.recon, x).mean()
        weighted = self.cfg.perceptual_weight * p
        through = weighted if parts.through is None else parts.through + weighted
        logs = {**parts.logs, "perceptual": p.detach()}
        return Parts(parts.recon, through, parts.rest, logs, parts.rest_is_reconstruction)

    def training(
        self,
        parts: Parts,
        x: torch.Tensor,
        discriminator: nn.Module | None,
        last_layer: nn.Parameter | None,
        step: int,
        with_stats: bool,
    ) -> Terms:
        """The batch's terms at optimizer step `step`; `with_stats` on the loggers' cadence
        (one device sync, for this rank's GanStats)."""
        parts = self.perceptual(parts, x)
        loss, logs = parts.loss(), parts.logs
        if discriminator is None:
            return Terms(loss, loss, logs)
        if step < self.cfg.disc_start or parts.recon is None or last_layer is None:
            unused = sum(p.sum() for p in discriminator.parameters())
            return Terms(loss, loss + 0.0 * unused, logs)
        nll_at_last = None
        if parts.rest is not None and parts.rest_is_reconstruction:
            nll_at_last = torch.autograd.grad(
                parts.rest, last_layer, retain_graph=True, allow_unused=True
            )[0]
        gen = generator_gradient(
            parts.recon, parts.through, discriminator, last_layer, self.cfg.disc_weight,
            nll_at_last,
        )  # fmt: skip
        logits_real, logits_fake = discriminator(x), discriminator(parts.recon.detach())
        d_loss = hinge_d_loss(logits_real, logits_fake)
        backward = surrogate(parts.recon, gen.grad) + d_loss
        if parts.rest is not None:
            backward = backward + parts.rest
        logs = {
            **logs,
            "g_loss": gen.g_loss,
            "d_loss": d_loss.detach(),
            "d_weight": gen.ratio * self.cfg.disc_weight,
            "logits_real": logits_real.detach().mean(),
            "logits_fake": logits_fake.detach().mean(),
        }
        stats = None
        if with_stats:
            stats = GanStats.of(
                logits_real, logits_fake, gen.ratio, self.cfg.disc_weight, gen.g_loss, d_loss
            )
            logs["d_accuracy"] = torch.tensor(stats.d_accuracy)
        return Terms(loss, backward, logs, stats)

    def report(self, step: int, rank: int, stats: GanStats) -> None:
        """This rank's GAN_STATS line, its watch's warnings, and its stats file for rank 0."""
        logger.info(
            GAN_STATS.format(
                step=step, d_real=f"{stats.logits_real:.4g}", d_fake=f"{stats.logits_fake:.4g}",
                d_acc=f"{stats.d_accuracy:.4g}", d_weight=f"{stats.d_weight:.4g}",
                g_loss=f"{stats.g_loss:.4g}", d_loss=f"{stats.d_loss:.4g}",
            )
        )  # fmt: skip
        for line in self.watch.observe(step, stats):
            logger.warning(line)  # every rank's WARNING also reaches the train log
        if self.stats_file is not None:
            record = {"rank": rank, "step": step, **asdict(stats)}
            # Not fsynced: rewritten every cadence, of use while the machine is up.
            atomic_files.write(self.stats_file, json.dumps(record).encode(), durable=False)


def load_perceptual(cfg: ObjectiveConfig) -> LPIPS | None:
    """LPIPS from `--perceptual_weights` when `--perceptual_weight` > 0 (the launcher checked the
    files exist; a wrong one is a WeightsFileError naming it)."""
    if cfg.perceptual_weight == 0:
        return None
    files = resolve(cfg.perceptual_weights)
    lpips = load_lpips(files.vgg16, files.heads)
    main_log.info(f"LPIPS: VGG16 from {files.vgg16}, heads from {files.heads}")
    return lpips
