"""`--model=mlp`: Linear + GELU layers of `--hidden_dims` widths down to a `--latent_dim` vector,
and the mirror image back up."""

from __future__ import annotations

import itertools

from torch import nn


def mlp_autoencoder(
    dim: int, widths: tuple[int, ...], latent: int, latent_out: int | None = None
) -> tuple[nn.Module, nn.Module]:
    """Encoder dim -> widths... -> latent, decoder latent -> reversed widths... -> dim. No
    activation after either last layer: the latent and the output are unbounded. `latent_out`:
    the encoder's output width when it differs from `latent` (a VAE's: 2 x latent)."""

    def stack(sizes: list[int]) -> nn.Sequential:
        layers: list[nn.Module] = []
        for a, b in itertools.pairwise(sizes):
            layers += [nn.Linear(a, b), nn.GELU()]
        return nn.Sequential(*layers[:-1])

    return stack([dim, *widths, latent_out or latent]), stack([latent, *reversed(widths), dim])
