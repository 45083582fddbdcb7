"""A randomly initialised FID Inception v3 in pytorch-fid's state-dict format
(`pt_inception-2015-12-05-6726825d.pth`: torchvision's Inception3 key names, a 1008-class `fc`,
no AuxLogits). Never the real weights: none come into the repository.

The conv shapes are written out, taken once from pytorch-fid 0.3.0's `fid_inception_v3()` model
(torchvision 0.28's Inception3 with pytorch-fid's FID blocks): not derived from the code under
test. Each conv is followed by a batch norm of its output channels (`bn.weight`, `bn.bias`,
`bn.running_mean`, `bn.running_var`, `bn.num_batches_tracked`).
"""

from __future__ import annotations

import torch

# name: (out, in, kh, kw) of `<name>.conv.weight`
INCEPTION_CONVS = {
    "Conv2d_1a_3x3": (32, 3, 3, 3),
    "Conv2d_2a_3x3": (32, 32, 3, 3),
    "Conv2d_2b_3x3": (64, 32, 3, 3),
    "Conv2d_3b_1x1": (80, 64, 1, 1),
    "Conv2d_4a_3x3": (192, 80, 3, 3),
    "Mixed_5b.branch1x1": (64, 192, 1, 1),
    "Mixed_5b.branch5x5_1": (48, 192, 1, 1),
    "Mixed_5b.branch5x5_2": (64, 48, 5, 5),
    "Mixed_5b.branch3x3dbl_1": (64, 192, 1, 1),
    "Mixed_5b.branch3x3dbl_2": (96, 64, 3, 3),
    "Mixed_5b.branch3x3dbl_3": (96, 96, 3, 3),
    "Mixed_5b.branch_pool": (32, 192, 1, 1),
    "Mixed_5c.branch1x1": (64, 256, 1, 1),
    "Mixed_5c.branch5x5_1": (48, 256, 1, 1),
    "Mixed_5c.branch5x5_2": (64, 48, 5, 5),
    "Mixed_5c.branch3x3dbl_1": (64, 256, 1, 1),
    "Mixed_5c.branch3x3dbl_2": (96, 64, 3, 3),
    "Mixed_5c.branch3x3dbl_3": (96, 96, 3, 3),
    "Mixed_5c.branch_pool": (64, 256, 1, 1),
    "Mixed_5d.branch1x1": (64, 288, 1, 1),
    "Mixed_5d.branch5x5_1": (48, 288, 1, 1),
    "Mixed_5d.branch5x5_2": (64, 48, 5, 5),
    "Mixed_5d.branch3x3dbl_1": (64, 288, 1, 1),
    "Mixed_5d.branch3x3dbl_2": (96, 64, 3, 3),
    "Mixed_5d.branch3x3dbl_3": (96, 96, 3, 3),
    "Mixed_5d.branch_pool": (64, 288, 1, 1),
    "Mixed_6a.branch3x3": (384, 288, 3, 3),
    "Mixed_6a.branch3x3dbl_1": (64, 288, 1, 1),
    "Mixed_6a.branch3x3dbl_2": (96, 64, 3, 3),
    "Mixed_6a.branch3x3dbl_3": (96, 96, 3, 3),
    "Mixed_6b.branch1x1": (192, 768, 1, 1),
    "Mixed_6b.branch7x7_1": (128, 768, 1, 1),
    "Mixed_6b.branch7x7_2": (128, 128, 1, 7),
    "Mixed_6b.branch7x7_3": (192, 128, 7, 1),
    "Mixed_6b.branch7x7dbl_1": (128, 768, 1, 1),
    "Mixed_6b.branch7x7dbl_2": (128, 128, 7, 1),
    "Mixed_6b.branch7x7dbl_3": (128, 128, 1, 7),
    "Mixed_6b.branch7x7dbl_4": (128, 128, 7, 1),
    "Mixed_6b.branch7x7dbl_5": (192, 128, 1, 7),
    "Mixed_6b.branch_pool": (192, 768, 1, 1),
    "Mixed_6c.branch1x1": (192, 768, 1, 1),
    "Mixed_6c.branch7x7_1": (160, 768, 1, 1),
    "Mixed_6c.branch7x7_2": (160, 160, 1, 7),
    "Mixed_6c.branch7x7_3": (192, 160, 7, 1),
    "Mixed_6c.branch7x7dbl_1": (160, 768, 1, 1),
    "Mixed_6c.branch7x7dbl_2": (160, 160, 7, 1),
    "Mixed_6c.branch7x7dbl_3": (160, 160, 1, 7),
    "Mixed_6c.branch7x7dbl_4": (160, 160, 7, 1),
    "Mixed_6c.branch7x7dbl_5": (192, 160, 1, 7),
    "Mixed_6c.branch_pool": (192, 768, 1, 1),
    "Mixed_6d.branch1x1": (192, 768, 1, 1),
    "Mixed_6d.branch7x7_1": (160, 768, 1, 1),
    "Mixed_6d.branch7x7_2": (160, 160, 1, 7),
    "Mixed_6d.branch7x7_3": (192, 160, 7, 1),
    "Mixed_6d.branch7x7dbl_1": (160, 768, 1, 1),
    "Mixed_6d.branch7x7dbl_2": (160, 160, 7, 1),
    "Mixed_6d.branch7x7dbl_3": (160, 160, 1, 7),
    "Mixed_6d.branch7x7dbl_4": (160, 160, 7, 1),
    "Mixed_6d.branch7x7dbl_5": (192, 160, 1, 7),
    "Mixed_6d.branch_pool": (192, 768, 1, 1),
    "Mixed_6e.branch1x1": (192, 768, 1, 1),
    "Mixed_6e.branch7x7_1": (192, 768, 1, 1),
    "Mixed_6e.branch7x7_2": (192, 192, 1, 7),
    "Mixed_6e.branch7x7_3": (192, 192, 7, 1),
    "Mixed_6e.branch7x7dbl_1": (192, 768, 1, 1),
    "Mixed_6e.branch7x7dbl_2": (192, 192, 7, 1),
    "Mixed_6e.branch7x7dbl_3": (192, 192, 1, 7),
    "Mixed_6e.branch7x7dbl_4": (192, 192, 7, 1),
    "Mixed_6e.branch7x7dbl_5": (192, 192, 1, 7),
    "Mixed_6e.branch_pool": (192, 768, 1, 1),
    "Mixed_7a.branch3x3_1": (192, 768, 1, 1),
    "Mixed_7a.branch3x3_2": (320, 192, 3, 3),
    "Mixed_7a.branch7x7x3_1": (192, 768, 1, 1),
    "Mixed_7a.branch7x7x3_2": (192, 192, 1, 7),
    "Mixed_7a.branch7x7x3_3": (192, 192, 7, 1),
    "Mixed_7a.branch7x7x3_4": (192, 192, 3, 3),
    "Mixed_7b.branch1x1": (320, 1280, 1, 1),
    "Mixed_7b.branch3x3_1": (384, 1280, 1, 1),
    "Mixed_7b.branch3x3_2a": (384, 384, 1, 3),
    "Mixed_7b.branch3x3_2b": (384, 384, 3, 1),
    "Mixed_7b.branch3x3dbl_1": (448, 1280, 1, 1),
    "Mixed_7b.branch3x3dbl_2": (384, 448, 3, 3),
    "Mixed_7b.branch3x3dbl_3a": (384, 384, 1, 3),
    "Mixed_7b.branch3x3dbl_3b": (384, 384, 3, 1),
    "Mixed_7b.branch_pool": (192, 1280, 1, 1),
    "Mixed_7c.branch1x1": (320, 2048, 1, 1),
    "Mixed_7c.branch3x3_1": (384, 2048, 1, 1),
    "Mixed_7c.branch3x3_2a": (384, 384, 1, 3),
    "Mixed_7c.branch3x3_2b": (384, 384, 3, 1),
    "Mixed_7c.branch3x3dbl_1": (448, 2048, 1, 1),
    "Mixed_7c.branch3x3dbl_2": (384, 448, 3, 3),
    "Mixed_7c.branch3x3dbl_3a": (384, 384, 1, 3),
    "Mixed_7c.branch3x3dbl_3b": (384, 384, 3, 1),
    "Mixed_7c.branch_pool": (192, 2048, 1, 1),
}  # fmt: skip
FC_CLASSES = 1008


def random_inception(seed: int = 0, classes: int = FC_CLASSES) -> dict[str, torch.Tensor]:
    """He-initialised convs, batch norms near the identity (so activations keep their scale
    through 94 layers), a small random classifier of `classes` outputs."""
    g = torch.Generator().manual_seed(seed)
    state: dict[str, torch.Tensor] = {}
    for name, (cout, cin, kh, kw) in INCEPTION_CONVS.items():
        std = (2.0 / (cin * kh * kw)) ** 0.5
        state[f"{name}.conv.weight"] = torch.randn(cout, cin, kh, kw, generator=g) * std
        state[f"{name}.bn.weight"] = 1 + 0.1 * torch.rand(cout, generator=g)
        state[f"{name}.bn.bias"] = 0.05 * torch.randn(cout, generator=g)
        state[f"{name}.bn.running_mean"] = 0.05 * torch.randn(cout, generator=g)
        state[f"{name}.bn.running_var"] = 1 + 0.1 * torch.rand(cout, generator=g)
        state[f"{name}.bn.num_batches_tracked"] = torch.tensor(0)
    state["fc.weight"] = torch.randn(classes, 2048, generator=g) * 0.01
    state["fc.bias"] = torch.zeros(classes)
    return state
