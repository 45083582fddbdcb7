"""A tiny model that writes down which samples each rank trains on: `--model=
tests.support.key_recorder:KeyRecorder` on `id_samples` shards (each vector holds its key's
number), with `AE_TEST_KEYS` naming a folder. Each training batch appends its sample numbers to
`<folder>/rank<R>.txt`, one line per batch (validation and ae's probes run in eval mode: not
recorded)."""

import os
from pathlib import Path

import torch
from torch import nn


class KeyRecorder(nn.Module):
    def __init__(self, input_shape: tuple[int, ...], latent: int = 2) -> None:
        super().__init__()
        self.encoder = nn.Linear(input_shape[0], latent)
        self.decoder = nn.Linear(latent, input_shape[0])

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        if self.training and torch.is_grad_enabled() and "AE_TEST_KEYS" in os.environ:
            out = Path(os.environ["AE_TEST_KEYS"]) / f"rank{os.environ.get('RANK', '0')}.txt"
            with out.open("a") as f:
                f.write(" ".join(str(int(v)) for v in x[:, 0].tolist()) + "\n")
        return self.encoder(x)

    def decode(self, z: torch.Tensor) -> torch.Tensor:
        return self.decoder(z)
