"""`Tiny`: a 4 -> 4 linear LightningModule trained to reproduce its input (AdamW, lr 0.1), which
keeps its weights after each optimizer step, for the non-finite guard's tests."""

from __future__ import annotations

import lightning as L
import torch
from torch import nn


class Tiny(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Linear(4, 4)
        self.weights: dict[int, torch.Tensor] = {}  # after each optimizer step

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: torch.Tensor, idx: int) -> torch.Tensor:
        return ((self.net(batch) - batch) ** 2).mean()

    def on_train_batch_end(self, outputs, batch, idx) -> None:
        self.weights[self.trainer.global_step] = self.net.weight.detach().clone()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=0.1)
