"""`--model=resnet`: a convolutional autoencoder with a spatial latent, in the family of the
autoencoders that latent-diffusion models run on.

Written from the papers' descriptions (residual blocks with group normalisation, a spatial latent
of a few channels at 1/f of the resolution, a mirrored decoder with nearest-neighbour upsampling):

    encoder: conv3x3 -> for each resolution: `--res_blocks` ResBlocks, then a stride-2 conv
             (but after the last) -> 2 ResBlocks -> GroupNorm, SiLU, conv3x3 to the latent
    decoder: conv3x3 from the latent -> 2 ResBlocks -> for each resolution, coarsest first:
             `--res_blocks` ResBlocks, then 2x nearest upsampling + conv3x3 (but after the
             last) -> GroupNorm, SiLU, conv3x3 to the image channels

`--downsample=f` gives log2(f) stride-2 stages, so log2(f)+1 resolutions whose widths are
`--base_channels` x the first log2(f)+1 of `--channel_mult`. The latent is `--latent_channels` x
H/f x W/f (twice the channels out of the encoder for a VAE: mean and log-variance). No attention
layers: they are what the large models add at the coarsest resolution, at a cost this trainer's
small-image use does not need.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.nn import functional as F


def _norm(channels: int) -> nn.GroupNorm:
    # 32 groups where the width allows it (the usual choice), else the largest divisor of both.
    return nn.GroupNorm(math.gcd(32, channels), channels)


class ResBlock(nn.Module):
    """x + conv(SiLU(norm(conv(SiLU(norm(x)))))), with a 1x1 conv on the skip path when the
    width changes. The second conv starts at zero, so every block starts as the identity (or its
    skip projection) and a deep stack trains from the first step."""

    def __init__(self, cin: int, cout: int) -> None:
        super().__init__()
        self.norm1 = _norm(cin)
        self.conv1 = nn.Conv2d(cin, cout, 3, padding=1)
        self.norm2 = _norm(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, padding=1)
        nn.init.zeros_(self.conv2.weight)
        nn.init.zeros_(self.conv2.bias)
        self.skip = nn.Conv2d(cin, cout, 1) if cin != cout else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.conv1(F.silu(self.norm1(x)))
        h = self.conv2(F.silu(self.norm2(h)))
        return self.skip(x) + h


class Upsample(nn.Module):
    """2x nearest-neighbour, then a 3x3 conv (no checkerboard artefacts of transposed convs)."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(channels, channels, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(F.interpolate(x, scale_factor=2.0, mode="nearest"))


def _head(channels: int, out: int) -> list[nn.Module]:
    return [_norm(channels), nn.SiLU(), nn.Conv2d(channels, out, 3, padding=1)]


def resnet_encoder(
    in_channels: int, widths: list[int], res_blocks: int, out_channels: int
) -> nn.Sequential:
    layers: list[nn.Module] = [nn.Conv2d(in_channels, widths[0], 3, padding=1)]
    ch = widths[0]
    for level, width in enumerate(widths):
        for _ in range(res_blocks):
            layers.append(ResBlock(ch, width))
            ch = width
        if level < len(widths) - 1:
            # stride 2, kernel 3, padding 1: exactly H/2 x W/2 for even H and W
            layers.append(nn.Conv2d(ch, ch, 3, stride=2, padding=1))
    layers += [ResBlock(ch, ch), ResBlock(ch, ch), *_head(ch, out_channels)]
    return nn.Sequential(*layers)


def resnet_decoder(
    latent_channels: int, widths: list[int], res_blocks: int, out_channels: int
) -> nn.Sequential:
    ch = widths[-1]
    layers: list[nn.Module] = [nn.Conv2d(latent_channels, ch, 3, padding=1)]
    layers += [ResBlock(ch, ch), ResBlock(ch, ch)]
    for level, width in enumerate(reversed(widths)):
        for _ in range(res_blocks):
            layers.append(ResBlock(ch, width))
            ch = width
        if level < len(widths) - 1:
            layers.append(Upsample(ch))
    layers += _head(ch, out_channels)
    return nn.Sequential(*layers)


def resnet_autoencoder(
    shape: tuple[int, ...],
    *,
    downsample: int,
    base_channels: int,
    channel_mult: tuple[int, ...],
    res_blocks: int,
    latent_channels: int,
    latent_out: int | None = None,
) -> tuple[nn.Module, nn.Module]:
    """Encoder and decoder for (C, H, W) images; H and W must be multiples of `downsample`.
    `latent_out`: the encoder's output channels when they differ from `latent_channels`."""
    levels = downsample.bit_length()  # log2(f) + 1 resolutions
    widths = [base_channels * m for m in channel_mult[:levels]]
    c = shape[0]
    encoder = resnet_encoder(c, widths, res_blocks, latent_out or latent_channels)
    decoder = resnet_decoder(latent_channels, widths, res_blocks, c)
    return encoder, decoder
