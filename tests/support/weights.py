"""Weights files the tests make: a randomly initialised VGG16 in torchvision's state-dict format
(`features.N.weight`, plus classifier keys, which the loader must ignore) and LPIPS v0.1 heads in
the lpips package's format. Never real weights: none come into the repository."""

from __future__ import annotations

from pathlib import Path

import torch

# torchvision's VGG16 `features` conv indices and shapes, written out (not derived from the code
# under test).
VGG16_CONVS = {
    0: (64, 3), 2: (64, 64), 5: (128, 64), 7: (128, 128), 10: (256, 128), 12: (256, 256),
    14: (256, 256), 17: (512, 256), 19: (512, 512), 21: (512, 512), 24: (512, 512),
    26: (512, 512), 28: (512, 512),
}  # fmt: skip
HEAD_CHANNELS = (64, 128, 256, 512, 512)


def random_vgg16(seed: int = 0) -> dict[str, torch.Tensor]:
    """He-initialised, as torchvision initialises an untrained VGG16, so activations keep their
    scale through 13 layers; classifier keys of the full model's names (small, not its shapes:
    the loader ignores them)."""
    g = torch.Generator().manual_seed(seed)
    state = {}
    for i, (cout, cin) in VGG16_CONVS.items():
        std = (2.0 / (cout * 9)) ** 0.5
        state[f"features.{i}.weight"] = torch.randn(cout, cin, 3, 3, generator=g) * std
        state[f"features.{i}.bias"] = torch.randn(cout, generator=g) * 0.01
    state["classifier.0.weight"] = torch.zeros(4, 4)
    state["classifier.6.bias"] = torch.zeros(1000)
    return state


def random_heads(seed: int = 1) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        f"lin{i}.model.1.weight": torch.rand(1, c, 1, 1, generator=g)
        for i, c in enumerate(HEAD_CHANNELS)
    }


def save(state: dict[str, torch.Tensor], path: Path, *, legacy: bool = False) -> Path:
    """`legacy`: torch's pre-zip format, the one torchvision's own VGG16 file is in."""
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(state, path, _use_new_zipfile_serialization=not legacy)
    return path
