"""A user autoencoder with a parameter its loss never uses, as CompressAI's entropy bottleneck has
(its quantiles are trained by a separate aux loss): `--model=tests.support.unused_param_autoencoder
:SkipsAParameter`. Its `loss` returns a bare tensor, which ae takes as the loss."""

import math

import torch
from torch import nn


class SkipsAParameter(nn.Module):
    def __init__(self, input_shape: tuple[int, ...], latent: int = 4) -> None:
        super().__init__()
        self.input_shape = tuple(input_shape)
        dim = math.prod(input_shape)
        self.encoder = nn.Sequential(nn.Flatten(), nn.Linear(dim, latent))
        self.decoder = nn.Linear(latent, dim)
        self.quantiles = nn.Parameter(torch.zeros(3))  # no gradient from loss()

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        return self.encoder(x)

    def decode(self, z: torch.Tensor) -> torch.Tensor:
        return self.decoder(z).view(-1, *self.input_shape)

    def loss(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.mse_loss(self.decode(self.encode(x)), x)
