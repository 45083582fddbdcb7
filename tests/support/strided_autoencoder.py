"""User models with the output layouts of third-party autoencoders (diffusers, timm, taming):
what ae must train, validate, sample and encode as they are, and one it must refuse."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn


class StridedAutoEncoder(nn.Module):
    """Images. `encode` returns a channels-last float16 latent; `decode` computes per pixel in
    NHWC and returns the NCHW permutation of it: a non-contiguous tensor."""

    def __init__(self, input_shape: tuple[int, ...], latent_channels: int = 4) -> None:
        super().__init__()
        c, _, _ = input_shape
        self.encoder = nn.Conv2d(c, latent_channels, 3, stride=2, padding=1)
        self.decoder = nn.ConvTranspose2d(latent_channels, 8, 4, stride=2, padding=1)
        self.head = nn.Linear(8, c)  # over the channels of each pixel, NHWC

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        z = self.encoder(x)
        return z.to(torch.float16).contiguous(memory_format=torch.channels_last)

    def decode(self, z: torch.Tensor) -> torch.Tensor:
        y = self.head(self.decoder(z.float()).permute(0, 2, 3, 1))
        return torch.sigmoid(y).permute(0, 3, 1, 2)


@dataclass
class DecoderOutput:
    """What diffusers' decoders return (`return_dict=True`): the image in `.sample`."""

    sample: torch.Tensor


class ReturnsDecoderOutput(StridedAutoEncoder):
    """`decode` returns the dataclass, not the tensor in it."""

    def decode(self, z: torch.Tensor) -> DecoderOutput:  # type: ignore[override]
        return DecoderOutput(sample=super().decode(z))
