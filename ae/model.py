"""The autoencoder: an MLP for vectors, a small conv net for images; MSE loss, AdamW."""

from __future__ import annotations

import functools

import lightning as L
import torch
from torch import nn

from ae.decode import InputSpec
from ae.fault_injection import fault_point
from ae.lr import lr_factor


def mlp_autoencoder(dim: int, hidden: int, latent: int) -> tuple[nn.Module, nn.Module]:
    encoder = nn.Sequential(
        nn.Linear(dim, hidden), nn.GELU(), nn.Linear(hidden, hidden // 2), nn.GELU(),
        nn.Linear(hidden // 2, latent),
    )  # fmt: skip
    decoder = nn.Sequential(
        nn.Linear(latent, hidden // 2), nn.GELU(), nn.Linear(hidden // 2, hidden), nn.GELU(),
        nn.Linear(hidden, dim),
    )  # fmt: skip
    return encoder, decoder


def conv_autoencoder(
    shape: tuple[int, ...], hidden: int, latent: int
) -> tuple[nn.Module, nn.Module]:
    """Stride-2 convs halve H and W while both stay even and above 4 (at most 4 times); the
    decoder mirrors them with transposed convs, which exactly double, so output shape == input."""
    c, h, w = shape
    widths = []
    ch = max(8, hidden // 8)
    while h % 2 == 0 and w % 2 == 0 and min(h, w) > 4 and len(widths) < 4:
        widths.append(ch)
        h, w, ch = h // 2, w // 2, ch * 2
    enc: list[nn.Module] = []
    prev = c
    for width in widths:
        enc += [nn.Conv2d(prev, width, 4, stride=2, padding=1), nn.GELU()]
        prev = width
    enc += [nn.Flatten(), nn.Linear(prev * h * w, latent)]
    dec: list[nn.Module] = [
        nn.Linear(latent, prev * h * w),
        nn.GELU(),
        nn.Unflatten(1, (prev, h, w)),
    ]
    for width in reversed([c, *widths[:-1]]):
        dec += [nn.ConvTranspose2d(prev, width, 4, stride=2, padding=1), nn.GELU()]
        prev = width
    if widths:
        dec.pop()  # no activation on the output layer
    else:
        dec += [nn.Conv2d(prev, c, 3, padding=1)]
    return nn.Sequential(*enc), nn.Sequential(*dec)


class AutoEncoder(L.LightningModule):
    def __init__(
        self,
        spec: InputSpec,
        hidden_dim: int = 256,
        latent_dim: int = 16,
        learning_rate: float = 1e-3,
        weight_decay: float = 1e-4,
        warmup_steps: int = 0,
        lr_scheduler: str = "cosine",
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        if spec.kind == "vector":
            self.encoder, self.decoder = mlp_autoencoder(spec.shape[0], hidden_dim, latent_dim)
        else:
            self.encoder, self.decoder = conv_autoencoder(spec.shape, hidden_dim, latent_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.decoder(self.encoder(x))

    def _loss(self, batch: torch.Tensor) -> torch.Tensor:
        return nn.functional.mse_loss(self(batch), batch)

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        fault_point("train", self.global_step)
        loss = self._loss(batch)
        self.log("train/loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        loss = self._loss(batch)
        self.log("val/loss", loss, prog_bar=True, sync_dist=True)
        return loss

    def configure_optimizers(self) -> dict:
        hp = self.hparams
        opt = torch.optim.AdamW(
            self.parameters(), lr=hp.learning_rate, weight_decay=hp.weight_decay
        )
        total = int(self.trainer.estimated_stepping_batches)
        schedule = functools.partial(
            lr_factor, warmup_steps=hp.warmup_steps, total_steps=total, kind=hp.lr_scheduler
        )
        sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}
