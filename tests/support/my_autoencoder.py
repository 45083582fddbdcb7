"""An autoencoder of your own for `ae`: `--model=my_autoencoder:TinyAutoEncoder`.

The example of docs/TRAINING.md ("Your own model"), trained by tests/e2e/test_models.py.
"""

import math

from torch import nn


class TinyAutoEncoder(nn.Module):
    def __init__(self, input_shape: tuple[int, ...], latent: int = 8, width: int = 64) -> None:
        super().__init__()  # input_shape: one sample's shape, (D,) or (C, H, W), given by ae
        self.input_shape = tuple(input_shape)
        dim = math.prod(input_shape)
        self.encoder = nn.Sequential(
            nn.Flatten(), nn.Linear(dim, width), nn.SiLU(), nn.Linear(width, latent)
        )
        self.decoder = nn.Sequential(nn.Linear(latent, width), nn.SiLU(), nn.Linear(width, dim))

    def encode(self, x):
        return self.encoder(x)

    def decode(self, z):
        return self.decoder(z).view(-1, *self.input_shape)

    def loss(self, x):  # optional: without it, ae applies --loss to decode(encode(x))
        z = self.encode(x)
        recon = nn.functional.mse_loss(self.decode(z), x)
        return recon + 1e-3 * z.pow(2).mean(), {"recon": recon}
