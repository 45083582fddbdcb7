"""The PatchGAN discriminator, the hinge loss, the adaptive weight against taming's own way of
computing it, and the per-rank watch."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from ae.training.adversarial import (
    ADAPTIVE_CLAMP,
    WATCH_POINTS,
    GanStats,
    GanWatch,
    NLayerDiscriminator,
    d_accuracy,
    generator_gradient,
    hinge_d_loss,
    surrogate,
)

# taming's NLayerDiscriminator(input_nc=3, ndf=64, n_layers=3), its state dict written out.
TAMING_KEYS = {
    "main.0.weight": (64, 3, 4, 4), "main.0.bias": (64,),
    "main.2.weight": (128, 64, 4, 4), "main.3.weight": (128,), "main.3.bias": (128,),
    "main.3.running_mean": (128,), "main.3.running_var": (128,), "main.3.num_batches_tracked": (),
    "main.5.weight": (256, 128, 4, 4), "main.6.weight": (256,), "main.6.bias": (256,),
    "main.6.running_mean": (256,), "main.6.running_var": (256,), "main.6.num_batches_tracked": (),
    "main.8.weight": (512, 256, 4, 4), "main.9.weight": (512,), "main.9.bias": (512,),
    "main.9.running_mean": (512,), "main.9.running_var": (512,), "main.9.num_batches_tracked": (),
    "main.11.weight": (1, 512, 4, 4), "main.11.bias": (1,),
}  # fmt: skip
# ae's keeps no running statistics (DDP would broadcast them every step; only eval mode reads
# them, and the discriminator always runs in training mode).
RUNNING = ("running_mean", "running_var", "num_batches_tracked")


def test_the_layout_is_tamings() -> None:
    d = NLayerDiscriminator(3, 64, 3)
    params = {k: v for k, v in TAMING_KEYS.items() if not k.endswith(RUNNING)}
    assert {k: tuple(v.shape) for k, v in d.state_dict().items()} == params
    assert list(d.buffers()) == []
    # a taming discriminator's weights load (its running statistics are left out)
    taming = {k: torch.full(shape, 0.5) for k, shape in TAMING_KEYS.items()}
    result = d.load_state_dict(taming, strict=False)
    assert result.missing_keys == [] and len(result.unexpected_keys) == 9
    assert torch.equal(d.main[8].weight, torch.full((512, 256, 4, 4), 0.5))


@pytest.mark.parametrize(("size", "patches"), [(256, 30), (64, 6)])
def test_one_logit_per_patch(size: int, patches: int) -> None:
    out = NLayerDiscriminator(3)(torch.rand(2, 3, size, size))
    assert out.shape == (2, 1, patches, patches)


def test_init_is_tamings() -> None:
    torch.manual_seed(0)
    d = NLayerDiscriminator(3)
    conv = d.main[8].weight
    assert abs(conv.std().item() - 0.02) < 0.001 and abs(conv.mean().item()) < 0.001
    bn = d.main[9]
    assert abs(bn.weight.mean().item() - 1.0) < 0.01 and bn.weight.std().item() < 0.03
    assert torch.equal(bn.bias, torch.zeros(512))


def test_hinge_and_accuracy() -> None:
    real = torch.tensor([2.0, 0.5, -1.0])
    fake = torch.tensor([-3.0, 0.0, 1.0])
    # real: relu(1 - r) = 0, 0.5, 2 -> mean 2.5/3; fake: relu(1 + f) = 0, 1, 2 -> mean 1
    assert hinge_d_loss(real, fake).item() == pytest.approx(0.5 * (2.5 / 3 + 1.0))
    # real right: 2 of 3; fake right (< 0): 1 of 3
    assert d_accuracy(real, fake).item() == pytest.approx(0.5 * (2 / 3 + 1 / 3))


class Decoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(4, 8, 3, padding=1), nn.SiLU())
        self.conv_out = nn.Conv2d(8, 3, 3, padding=1)

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        return self.conv_out(self.body(z))


def perceptual(a: torch.Tensor, b: torch.Tensor, net: nn.Module) -> torch.Tensor:
    return (net(a) - net(b)).pow(2).mean(dim=(1, 2, 3))


def taming_generator_grads(
    dec: Decoder, disc: nn.Module, feat: nn.Module, z: torch.Tensor, x: torch.Tensor, w: float
) -> tuple[list[torch.Tensor], float]:
    """LPIPSWithDiscriminator's generator step, as taming writes it: per-pixel L1 + perceptual
    broadcast over the pixels, summed and divided by the batch; the adaptive weight from two
    autograd.grad passes at the last layer; backward of the total. Returns the decoder's
    gradients / elements (ae's mean scale) and taming's d_weight."""
    recon = dec(z)
    rec = (x - recon).abs() + perceptual(x, recon, feat).view(-1, 1, 1, 1)
    nll = rec.sum() / rec.shape[0]
    g_loss = -disc(recon).mean()
    last = dec.conv_out.weight
    nll_grads = torch.autograd.grad(nll, last, retain_graph=True)[0]
    g_grads = torch.autograd.grad(g_loss, last, retain_graph=True)[0]
    d_weight = torch.clamp(nll_grads.norm() / (g_grads.norm() + 1e-4), 0.0, 1e4).detach() * w
    loss = nll + d_weight * g_loss
    grads = torch.autograd.grad(loss, list(dec.parameters()))
    elements = math.prod(x.shape[1:])
    return [g / elements for g in grads], d_weight.item()


def test_generator_gradient_is_tamings() -> None:
    torch.manual_seed(0)
    # float64: the two ways sum in other orders, and the discriminator's batch statistics make
    # float32's rounding differences visible at 1e-4
    dec, disc = Decoder().double(), NLayerDiscriminator(3, width=8, layers=2).double()
    feat = nn.Conv2d(3, 5, 3, padding=1).double().requires_grad_(False)
    z = torch.randn(2, 4, 32, 32, dtype=torch.float64)
    x = torch.rand(2, 3, 32, 32, dtype=torch.float64)
    expected, taming_weight = taming_generator_grads(dec, disc, feat, z, x, w=0.5)

    recon = dec(z)
    nll = F.l1_loss(recon, x) + perceptual(x, recon, feat).mean()
    out = generator_gradient(recon, nll, disc, dec.conv_out.weight, disc_weight=0.5)
    grads = torch.autograd.grad(surrogate(recon, out.grad), list(dec.parameters()))
    for got, want in zip(grads, expected, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-9)
    assert out.ratio.item() * 0.5 == pytest.approx(taming_weight, rel=1e-5)
    assert out.weight.item() == pytest.approx(taming_weight / (3 * 32 * 32), rel=1e-5)
    assert all(p.grad is None for p in disc.parameters())  # the generator's step trains no D


def test_a_vanished_adversarial_gradient_hits_the_clamp() -> None:
    dec = Decoder()
    recon = dec(torch.randn(1, 4, 8, 8))
    nll = recon.abs().mean()

    def flat(img: torch.Tensor) -> torch.Tensor:
        return 0 * img.sum() + torch.ones(1, 1, 2, 2)  # a D whose output ignores its input

    out = generator_gradient(recon, nll, flat, dec.conv_out.weight, disc_weight=0.5)
    assert out.ratio.item() == ADAPTIVE_CLAMP


def stats(acc: float = 0.7, weight: float = 1.0, g: float = 0.1) -> GanStats:
    return GanStats(0.3, -0.2, acc, weight, g, 0.9)


def test_watch_accuracy_held_at_one() -> None:
    watch = GanWatch(disc_weight=0.5)
    for step in range(WATCH_POINTS - 1):
        assert watch.observe(step, stats(acc=1.0)) == []
    [line] = watch.observe(99, stats(acc=1.0))
    assert line.startswith(f"GAN warning step 99: discriminator accuracy 1.0 for {WATCH_POINTS}")
    assert watch.observe(100, stats(acc=1.0)) == []  # once per episode
    assert watch.observe(110, stats(acc=0.9)) == [
        "GAN warning step 110: discriminator accuracy 1.0 no longer"
    ]


def test_watch_a_short_spell_is_not_news() -> None:
    watch = GanWatch(disc_weight=0.5)
    for step in range(3 * WATCH_POINTS):
        acc = 1.0 if step % WATCH_POINTS else 0.9  # never WATCH_POINTS in a row
        assert watch.observe(step, stats(acc=acc)) == []


def test_watch_weight_at_the_clamp_and_non_finite() -> None:
    watch = GanWatch(disc_weight=0.5)
    lines = [watch.observe(s, stats(weight=ADAPTIVE_CLAMP * 0.5)) for s in range(WATCH_POINTS)]
    assert lines[-1] and "adaptive weight at its clamp" in lines[-1][0]
    [line] = GanWatch(0.5).observe(7, stats(g=float("nan")))
    assert line.startswith("GAN warning step 7: non-finite")


def test_stats_of_tensors() -> None:
    real, fake = torch.tensor([1.0, 3.0]), torch.tensor([-2.0, 1.0])
    s = GanStats.of(real, fake, torch.tensor(4.0), 0.5, torch.tensor(0.25), torch.tensor(0.5))
    assert s == GanStats(2.0, -0.5, 0.75, 2.0, 0.25, 0.5)
