"""A LightningModule of your own for `ae`: `--model=my_lightning_autoencoder:LitAutoEncoder`.

Trained as it is (its own steps, logging and optimizer), with `ae`'s launcher, logs, checkpoints
and watchdog around it; `encode`/`decode` give it grids and `ae-encode`. Trained and resumed by
tests/e2e/test_models.py.
"""

import math

import lightning as L
import torch
from torch import nn


class LitAutoEncoder(L.LightningModule):
    def __init__(self, input_shape: tuple[int, ...], latent: int = 2, lr: float = 1e-3) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.input_shape = tuple(input_shape)
        dim = math.prod(input_shape)
        self.encoder = nn.Sequential(nn.Flatten(), nn.Linear(dim, latent))
        self.decoder = nn.Linear(latent, dim)

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        return self.encoder(x)

    def decode(self, z: torch.Tensor) -> torch.Tensor:
        return self.decoder(z).view(-1, *self.input_shape)

    def training_step(self, x: torch.Tensor, batch_idx: int) -> torch.Tensor:
        loss = nn.functional.mse_loss(self.decode(self.encode(x)), x)
        self.log("train/loss", loss)
        return loss

    def validation_step(self, x: torch.Tensor, batch_idx: int) -> None:
        loss = nn.functional.mse_loss(self.decode(self.encode(x)), x)
        self.log("val/loss", loss, sync_dist=True)  # what best.ckpt minimises

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=self.hparams.lr)
