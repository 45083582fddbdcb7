"""The adversarial half of the latent-diffusion autoencoder recipe: taming-transformers' PatchGAN
discriminator, its hinge loss, the adaptive weight of the generator's term, and what a rank
watches of it.

- `NLayerDiscriminator` is taming's (pix2pix's PatchGAN): 4x4 convs, stride 2 but for the last
  two, BatchNorm, LeakyReLU 0.2, one logit per patch; initialised by `weights_init` (conv
  weights N(0, 0.02), BatchNorm weights N(1, 0.02), biases 0). Same parameter names
  (`main.0.weight` ...), so a taming discriminator's weights load into it (`strict=False`: its
  BatchNorms have no running statistics here). Those statistics are used only in eval mode, and
  the discriminator is only ever run in training mode (batch statistics); as buffers they would
  make DDP broadcast them from rank 0 before every forward: a collective per step.
- `hinge_d_loss`: 0.5 (mean relu(1 - D(x)) + mean relu(1 + D(x_hat))); the generator's term is
  -mean D(x_hat).
- The adaptive weight (`generator_gradient`): taming scales the generator's term by
  ||grad_W nll|| / (||grad_W g|| + 1e-4), clamped to [0, 1e4], times `--disc_weight`, with W the
  decoder's last layer, so that the adversarial gradient there has a set share of the
  reconstruction's. taming gets both gradients with two `autograd.grad` passes through the whole
  loss graph (LPIPS's VGG included) and then backpropagates the total through it again.
  `generator_gradient` runs each loss's backward once, to the reconstruction x_hat only, gets the
  last layer's gradients from those (a backward through the last layer alone), and returns
  dL/dx_hat for the caller to push through the decoder: the same gradient, one LPIPS backward
  fewer (bench: `loss_terms_bench.py`).
- Scale: ae's losses are means over elements, taming's sums over a sample's elements
  (`elements` = C*H*W) divided by the batch. The ratio is therefore taken at taming's scale
  (x `elements`) before its eps and clamp, and brought back: the weight is exactly taming's /
  `elements`, and `GanStats.d_weight` is logged at taming's scale, comparable with its
  `train/d_weight`.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

from ae.log_lines import GAN_WARNING

ADAPTIVE_EPS = 1e-4  # taming's, added to ||grad_W g||
ADAPTIVE_CLAMP = 1e4  # taming's upper bound of the ratio
# The watch (`GanWatch`): a condition seen at this many consecutive logged steps is a warning.
WATCH_POINTS = 5


def weights_init(m: nn.Module) -> None:
    """taming's init (by class name, as it does): convs N(0, 0.02); BatchNorm N(1, 0.02), 0."""
    name = type(m).__name__
    if "Conv" in name:
        nn.init.normal_(m.weight, 0.0, 0.02)
    elif "BatchNorm" in name:
        nn.init.normal_(m.weight, 1.0, 0.02)
        nn.init.constant_(m.bias, 0.0)


class NLayerDiscriminator(nn.Module):
    """PatchGAN: a (B, 1, h, w) map of logits, one per overlapping patch (70x70 px at 3 layers).
    `channels`: the image channels; `width`: taming's ndf; `layers`: its n_layers."""

    def __init__(self, channels: int = 3, width: int = 64, layers: int = 3) -> None:
        super().__init__()
        seq: list[nn.Module] = [
            nn.Conv2d(channels, width, 4, stride=2, padding=1),
            nn.LeakyReLU(0.2, True),
        ]
        mult = 1
        for n in range(1, layers + 1):
            prev, mult = mult, min(2**n, 8)
            stride = 2 if n < layers else 1  # the last of these keeps the resolution
            seq += [
                nn.Conv2d(width * prev, width * mult, 4, stride=stride, padding=1, bias=False),
                nn.BatchNorm2d(width * mult, track_running_stats=False),
                nn.LeakyReLU(0.2, True),
            ]
        seq.append(nn.Conv2d(width * mult, 1, 4, stride=1, padding=1))
        self.main = nn.Sequential(*seq)
        self.apply(weights_init)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.main(x)


def hinge_d_loss(logits_real: torch.Tensor, logits_fake: torch.Tensor) -> torch.Tensor:
    return 0.5 * (F.relu(1.0 - logits_real).mean() + F.relu(1.0 + logits_fake).mean())


def d_accuracy(logits_real: torch.Tensor, logits_fake: torch.Tensor) -> torch.Tensor:
    """The share of patches the discriminator gets right: real > 0, reconstructed < 0."""
    return 0.5 * ((logits_real > 0).float().mean() + (logits_fake < 0).float().mean())


def adaptive_ratio(nll_norm: torch.Tensor, g_norm: torch.Tensor, elements: int) -> torch.Tensor:
    """taming's ||grad nll|| / (||grad g|| + eps), clamped, with `nll_norm` of a loss that is a
    mean over `elements` per sample (ae's) taken back to taming's per-sample sum."""
    return (nll_norm * elements / (g_norm + ADAPTIVE_EPS)).clamp(0.0, ADAPTIVE_CLAMP).detach()


@dataclass
class GeneratorGradient:
    """`grad`: dL/dx_hat of nll + weight * g_loss (detached), to backpropagate through the
    decoder; `weight`: the adaptive weight at ae's scale (x `--disc_weight`); `ratio`: taming's
    ratio before `--disc_weight` (its scale); `g_loss`: -mean D(x_hat)."""

    grad: torch.Tensor
    weight: torch.Tensor
    ratio: torch.Tensor
    g_loss: torch.Tensor


def generator_gradient(
    recon: torch.Tensor,
    nll: torch.Tensor | None,
    discriminator: nn.Module | Callable[[torch.Tensor], torch.Tensor],
    last_layer: torch.Tensor,
    disc_weight: float,
    nll_at_last: torch.Tensor | None = None,
) -> GeneratorGradient:
    """The generator's gradient at `recon` for nll + adaptive weight x (-mean D(recon)).

    `nll` must depend on the model's parameters through `recon` only (pixel and perceptual
    terms; the KL is added by the caller, it does not pass through x_hat), or be None. Each loss
    graph is walked once, to `recon`; the discriminator's parameters get no gradient from this
    (only `hinge_d_loss` on a detached x_hat trains it). `last_layer`: the decoder parameter
    whose gradients set the weight (the output conv's weight). `nll_at_last`: the gradient at
    `last_layer` of reconstruction terms that do not pass through `recon` (a user model's own
    loss, computed on its own forward), counted in the weight's numerator."""
    elements = math.prod(recon.shape[1:])
    # frees the LPIPS graph: it is not needed again
    g_nll = torch.autograd.grad(nll, recon)[0] if nll is not None else torch.zeros_like(recon)
    g_loss = -discriminator(recon).mean()
    g_adv = torch.autograd.grad(g_loss, recon)[0]
    # Only the last layer's backward: x_hat's gradients taken to W.
    w_nll, w_adv = (
        torch.autograd.grad(recon, last_layer, grad_outputs=g, retain_graph=True)[0]
        for g in (g_nll, g_adv)
    )
    if nll_at_last is not None:
        w_nll = w_nll + nll_at_last
    ratio = adaptive_ratio(w_nll.norm(), w_adv.norm(), elements)
    weight = ratio * disc_weight / elements
    return GeneratorGradient(
        grad=(g_nll + weight * g_adv).detach(),
        weight=weight,
        ratio=ratio,
        g_loss=g_loss.detach(),
    )


def surrogate(recon: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """A scalar whose gradient w.r.t. everything before `recon` is `grad` pushed back through it:
    what the trainer backpropagates (its value is meaningless: log the real losses)."""
    return (recon * grad).sum()


@dataclass
class GanStats:
    """One rank's view of the game at a step: what is logged, per rank, on the loggers' cadence.
    `d_weight` at taming's scale, x `--disc_weight` (its `train/d_weight`)."""

    logits_real: float
    logits_fake: float
    d_accuracy: float
    d_weight: float
    g_loss: float
    d_loss: float

    @classmethod
    def of(
        cls,
        logits_real: torch.Tensor,
        logits_fake: torch.Tensor,
        ratio: torch.Tensor,
        disc_weight: float,
        g_loss: torch.Tensor,
        d_loss: torch.Tensor,
    ) -> GanStats:
        """One device sync for all six (`tolist` of one stacked tensor)."""
        values = torch.stack(
            [
                logits_real.detach().mean(),
                logits_fake.detach().mean(),
                d_accuracy(logits_real.detach(), logits_fake.detach()),
                ratio.detach() * disc_weight,
                g_loss.detach(),
                d_loss.detach(),
            ]
        ).tolist()
        return cls(*values)


class GanWatch:
    """Warnings, per rank, from the stats at each logged step: the discriminator right on every
    patch (accuracy 1.0: the generator gets no useful signal), or the adaptive ratio at taming's
    clamp (the adversarial gradient at the decoder's last layer has all but vanished), each held
    for WATCH_POINTS logged steps in a row; a non-finite value at once. One warning per episode;
    a line when it ends."""

    def __init__(self, disc_weight: float) -> None:
        self.disc_weight = disc_weight
        self.runs = {"accuracy": 0, "weight": 0}
        self.active: set[str] = set()

    def observe(self, step: int, stats: GanStats) -> list[str]:
        lines = []
        values = [stats.logits_real, stats.logits_fake, stats.d_weight, stats.g_loss]
        if not all(math.isfinite(v) for v in [*values, stats.d_loss]):
            lines.append(
                GAN_WARNING.format(step=step, what=f"non-finite discriminator values: {stats}")
            )
        held = {
            "accuracy": stats.d_accuracy >= 1.0,
            "weight": stats.d_weight >= ADAPTIVE_CLAMP * self.disc_weight,
        }
        for name, on in held.items():
            self.runs[name] = self.runs[name] + 1 if on else 0
            if self.runs[name] >= WATCH_POINTS and name not in self.active:
                self.active.add(name)
                lines.append(self._warning(name, step))
            elif not on and name in self.active:
                self.active.discard(name)
                lines.append(GAN_WARNING.format(step=step, what=f"{self._what(name)} no longer"))
        return lines

    @staticmethod
    def _what(name: str) -> str:
        if name == "accuracy":
            return "discriminator accuracy 1.0"
        return f"adaptive weight at its clamp ({ADAPTIVE_CLAMP:g} x disc_weight)"

    def _warning(self, name: str, step: int) -> str:
        why = (
            "the discriminator tells every patch apart: the generator has lost and gets no "
            "useful gradient (lower --disc_lr or --disc_weight, or start it later)"
            if name == "accuracy"
            else "the adversarial gradient at the decoder's last layer has vanished next to the "
            "reconstruction's: the adversarial term is held at its cap"
        )
        what = f"{self._what(name)} for {WATCH_POINTS} logged steps: {why}"
        return GAN_WARNING.format(step=step, what=what)
