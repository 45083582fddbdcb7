"""The autoencoder: an MLP for vectors, a small conv net for images; MSE loss, AdamW."""

from __future__ import annotations

import functools

import lightning as L
import torch
from torch import nn

from ae.config import Config
from ae.decode import InputSpec
from ae.fault_injection import fault_point
from ae.log_lines import main_log
from ae.lr import lr_factor, scale_lr, schedule_line


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
        encoder_lr_mult: float = 1.0,
        decoder_lr_mult: float = 1.0,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        if spec.kind == "vector":
            self.encoder, self.decoder = mlp_autoencoder(spec.shape[0], hidden_dim, latent_dim)
        else:
            self.encoder, self.decoder = conv_autoencoder(spec.shape, hidden_dim, latent_dim)

    @classmethod
    def from_config(cls, spec: InputSpec, cfg: Config, world_size: int) -> AutoEncoder:
        return cls(
            spec,
            hidden_dim=cfg.hidden_dim,
            latent_dim=cfg.latent_dim,
            learning_rate=scale_lr(cfg.learning_rate, world_size, cfg.lr_scale),
            weight_decay=cfg.weight_decay,
            warmup_steps=cfg.warmup_steps,
            lr_scheduler=cfg.lr_scheduler,
            encoder_lr_mult=cfg.encoder_lr_mult,
            decoder_lr_mult=cfg.decoder_lr_mult,
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.decoder(self.encoder(x))

    def _loss(self, batch: torch.Tensor) -> torch.Tensor:
        return nn.functional.mse_loss(self(batch), batch)

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        fault_point("train", self.global_step)
        loss = self._loss(batch)
        # Per step: rank 0's own loss (a sync across ranks would cost a collective per step).
        self.log("train/loss", loss, prog_bar=True)
        # Epoch mean over all ranks: synced once, at the end of the epoch.
        self.log("train/loss_epoch", loss, on_step=False, on_epoch=True, sync_dist=True)
        return loss

    def validation_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        loss = self._loss(batch)
        self.log("val/loss", loss, prog_bar=True, sync_dist=True)
        return loss

    def configure_optimizers(self) -> dict:
        """AdamW with one parameter group per module (`--encoder_lr_mult`, `--decoder_lr_mult`),
        and the warmup + decay schedule applied to both, stepped once per optimizer step."""
        hp = self.hparams
        groups = [
            {"params": m.parameters(), "lr": hp.learning_rate * mult, "name": name}
            for name, m, mult in (
                ("encoder", self.encoder, hp.encoder_lr_mult),
                ("decoder", self.decoder, hp.decoder_lr_mult),
            )
        ]
        opt = torch.optim.AdamW(groups, lr=hp.learning_rate, weight_decay=hp.weight_decay)
        total = int(self.trainer.estimated_stepping_batches)
        if self.trainer.is_global_zero:
            main_log.info(schedule_line(hp.warmup_steps, total, hp.lr_scheduler))
        schedule = functools.partial(
            lr_factor, warmup_steps=hp.warmup_steps, total_steps=total, kind=hp.lr_scheduler
        )
        sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}
