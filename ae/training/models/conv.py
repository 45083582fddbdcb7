"""`--model=conv`: the small conv net for tiny images (the demo digits), the default for images.

Stride-2 convs halve H and W while both stay even and above 4 (at most 4 times), from
`--hidden_dim`/8 channels (at least 8), doubling per stage; then a flatten and one linear layer to
a `--latent_dim` vector. The decoder mirrors it with transposed convs, which exactly double, so
the output shape is the input shape. Its layer layout is that of the checkpoints written before
`--model` existed, which therefore still load.
"""

from __future__ import annotations

from torch import nn


def conv_autoencoder(
    shape: tuple[int, ...], hidden: int, latent: int, latent_out: int | None = None
) -> tuple[nn.Module, nn.Module]:
    """`latent_out`: the encoder's output width when it differs from `latent` (a VAE's encoder
    outputs a mean and a log-variance, 2 x latent)."""
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
    enc += [nn.Flatten(), nn.Linear(prev * h * w, latent_out or latent)]
    dec: list[nn.Module] = [
        nn.Linear(latent, prev * h * w),
        nn.GELU(),
        nn.Unflatten(1, (prev, h, w)),
    ]
    # One transposed conv per encoder stage: an odd or tiny image (7x7) has none, and a
    # transposed conv there would double it (the decoder gave 14x14 for 7x7 images).
    for width in reversed([c, *widths[:-1]]) if widths else []:
        dec += [nn.ConvTranspose2d(prev, width, 4, stride=2, padding=1), nn.GELU()]
        prev = width
    if widths:
        dec.pop()  # no activation on the output layer
    else:
        dec += [nn.Conv2d(prev, c, 3, padding=1)]
    return nn.Sequential(*enc), nn.Sequential(*dec)
