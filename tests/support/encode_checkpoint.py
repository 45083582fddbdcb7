"""A checkpoint that ae-encode takes, made without a training run: the built-in AutoEncoder
(hidden 16, latent 3) for `spec`, untrained, saved as the trainer saves its state."""

from __future__ import annotations

from pathlib import Path

import torch

from ae.config import Config, OptimConfig
from ae.data.decoding.decode import InputSpec
from ae.training.model import AutoEncoder


def encode_checkpoint(folder: Path, spec: InputSpec) -> Path:
    cfg = Config.from_flat({"hidden_dim": 16, "latent_dim": 3})
    model = AutoEncoder(spec, cfg.model, OptimConfig())
    path = folder / "m.ckpt"
    torch.save(
        {"state_dict": model.state_dict(), "ae_config": cfg.to_dict(),
         "hyper_parameters": dict(model.hparams), "global_step": 7},
        path,
    )  # fmt: skip
    return path
