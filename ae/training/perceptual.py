"""LPIPS (Zhang et al. 2018, v0.1) on VGG16 features: the perceptual term of `--perceptual_weight`
and the `val/lpips` metric.

Written here rather than imported: torchvision does not install beside ae's torch, and the
`lpips` package imports it. The layers keep torchvision's state-dict key names
(`features.0.weight` ... `features.28.bias`), so torchvision's own ImageNet file loads unchanged,
and the heads keep the `lpips` package's (`lin0.model.1.weight` ... `lin4.model.1.weight`), so
its v0.1 file loads unchanged. What LPIPS computes, in the `lpips` package's order:

    x in [0, 1] -> 2x - 1 -> (x - shift) / scale (ScalingLayer, ImageNet statistics in [-1, 1])
    -> VGG16 features after relu1_2, relu2_2, relu3_3, relu4_3, relu5_3
    -> each unit-normalised over channels (eps 1e-10 added to the norm)
    -> squared difference -> 1x1 conv head (1 output, no bias) -> spatial mean -> sum of the 5

Both files are read by the safe loader and checked key by key and shape by shape
(`ae.training.state_dict_file`): a wrong or truncated file is one `WeightsFileError` naming it
and what it should be, before any worker starts.

The net is frozen and must not become part of the trained module (its 14.7 M parameters would be
saved in every checkpoint, averaged by the EMA every step, copied by the EMA and broadcast by
DDP): `SharedNet` holds it beside the module instead.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from ae.training.state_dict_file import WeightsFileError, checked, read_state_dict

# torchvision's VGG16 `features`: 3x3 convs (padding 1) + ReLU, "M" = 2x2 max pool. Index i of
# this list is layer i of `features` (a conv's ReLU is the next index), as torchvision builds it.
VGG16_LAYOUT: tuple[int | str, ...] = (
    64, 64, "M", 128, 128, "M", 256, 256, 256, "M", 512, 512, 512, "M", 512, 512, 512, "M",
)  # fmt: skip
# Indices in `features` of the ReLUs LPIPS reads: relu1_2, relu2_2, relu3_3, relu4_3, relu5_3.
TAPS = (3, 8, 15, 22, 29)
TAP_CHANNELS = (64, 128, 256, 512, 512)
# The lpips package's ScalingLayer: ImageNet mean and std mapped to inputs in [-1, 1].
SHIFT = (-0.030, -0.088, -0.188)
SCALE = (0.458, 0.448, 0.450)

VGG16_FILE = "vgg16-397923af.pth"  # torchvision's IMAGENET1K_V1 file, as torch.hub caches it
VGG16_URL = f"https://download.pytorch.org/models/{VGG16_FILE}"
HEADS_FILE = "vgg.pth"  # lpips wheel: lpips/weights/v0.1/vgg.pth
HEADS_SOURCE = "the lpips wheel (pip download lpips==0.1.4 --no-deps): lpips/weights/v0.1/vgg.pth"


def vgg16_shapes() -> dict[str, tuple[int, ...]]:
    """{key: shape} of torchvision's VGG16 `features` up to relu5_3 (13 convs)."""
    shapes: dict[str, tuple[int, ...]] = {}
    index, cin = 0, 3
    for item in VGG16_LAYOUT:
        if item == "M":
            index += 1
            continue
        shapes[f"features.{index}.weight"] = (int(item), cin, 3, 3)
        shapes[f"features.{index}.bias"] = (int(item),)
        cin, index = int(item), index + 2  # the conv and its ReLU
    return shapes


def heads_shapes() -> dict[str, tuple[int, ...]]:
    return {f"lin{i}.model.1.weight": (1, c, 1, 1) for i, c in enumerate(TAP_CHANNELS)}


class VGG16Features(nn.Module):
    """torchvision's `vgg16().features` up to relu5_3 (the last max pool is never needed), same
    indices and key names; `forward` returns the five LPIPS taps."""

    def __init__(self) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        cin = 3
        for item in VGG16_LAYOUT:
            if item == "M":
                layers.append(nn.MaxPool2d(2, 2))
            else:
                layers += [nn.Conv2d(cin, int(item), 3, padding=1), nn.ReLU()]
                cin = int(item)
        self.features = nn.Sequential(*layers[: TAPS[-1] + 1])

    def forward(self, x: torch.Tensor) -> list[torch.Tensor]:
        taps = []
        for i, layer in enumerate(self.features):
            x = layer(x)
            if i in TAPS:
                taps.append(x)
        return taps


class LinearHead(nn.Module):
    """The lpips package's NetLinLayer: `model.0` a dropout (off in eval; no weights), `model.1`
    the 1x1 conv, so that its key names are those of the v0.1 file."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.model = nn.Sequential(nn.Dropout(), nn.Conv2d(channels, 1, 1, bias=False))


class LPIPS(nn.Module):
    """Learned perceptual distance between images in [0, 1] (ae's pixel range): per sample, a
    tensor of shape (B,). One-channel images are repeated to three. Always frozen, in eval mode
    (the heads' dropout is off)."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("shift", torch.tensor(SHIFT).view(1, 3, 1, 1))
        self.register_buffer("scale", torch.tensor(SCALE).view(1, 3, 1, 1))
        self.net = VGG16Features()
        for i, c in enumerate(TAP_CHANNELS):
            self.add_module(f"lin{i}", LinearHead(c))
        self.requires_grad_(False)
        self.eval()

    def train(self, mode: bool = True) -> LPIPS:
        return super().train(False)  # a metric: never dropout, whatever the owner's mode

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if x.shape[1] == 1:
            x, y = x.expand(-1, 3, -1, -1), y.expand(-1, 3, -1, -1)
        # Two passes, not one over both images: the target's pass builds no graph (nothing in
        # it needs a gradient), so backward runs through the reconstruction's half only.
        total = x.new_zeros(x.shape[0])
        taps = zip(self.net(self.scaled(x)), self.net(self.scaled(y)), strict=True)
        for i, (fx, fy) in enumerate(taps):
            head = getattr(self, f"lin{i}").model[1]
            total = total + head((unit(fx) - unit(fy)).pow(2)).mean(dim=(1, 2, 3))
        return total

    def scaled(self, x: torch.Tensor) -> torch.Tensor:
        return (x * 2 - 1 - self.shift) / self.scale


def unit(features: torch.Tensor) -> torch.Tensor:
    """Unit length over channels, as the lpips package's normalize_tensor (eps on the norm)."""
    return features / (features.pow(2).sum(1, keepdim=True).sqrt() + 1e-10)


def load_lpips(vgg16_path: Path, heads_path: Path) -> LPIPS:
    """LPIPS with torchvision's VGG16 ImageNet weights (`vgg16_path`) and the v0.1 heads
    (`heads_path`), frozen, on the CPU. Raises WeightsFileError naming the file at fault."""
    # Both files checked before either is refused: a user with two bad downloads fixes both
    # in one go.
    vgg16_what = f"torchvision's VGG16 state dict ({VGG16_FILE} from {VGG16_URL})"
    files = (
        (vgg16_path, vgg16_shapes(), vgg16_what),
        (heads_path, heads_shapes(), f"the LPIPS v0.1 VGG heads ({HEADS_SOURCE})"),
    )
    loaded: list[dict[str, torch.Tensor]] = []
    problems: list[str] = []
    for path, shapes, what in files:
        try:
            state = read_state_dict(path, "perceptual_weights")
            loaded.append(checked(state, shapes, path, "perceptual_weights", what))
        except WeightsFileError as e:
            problems.append(str(e))
    if problems:
        raise WeightsFileError("\n".join(problems))
    vgg, heads = loaded
    # LPIPS trains its heads clamped to >= 0: negative weights are another file (random, or a
    # head of another version), whose distances would mean nothing.
    negative = [k for k, t in heads.items() if (t < 0).any()]
    if negative:
        raise WeightsFileError(
            f"perceptual_weights: {heads_path} is not the LPIPS v0.1 VGG heads: "
            f"{', '.join(negative)} has negative weights ({HEADS_SOURCE})"
        )
    model = LPIPS()
    buffers = {"shift": model.shift, "scale": model.scale}
    model.load_state_dict({**buffers, **{f"net.{k}": v for k, v in vgg.items()}, **heads})
    return model


class SharedNet:
    """A frozen network a LightningModule uses but does not own: not a submodule, so it is in no
    state dict or checkpoint, not in `parameters()` (DDP neither wraps nor broadcasts it, the
    EMA does not average it), and `copy.deepcopy` of its owner (the EMA's copy of the module)
    shares it rather than copying it. Moved to the input's device at first use."""

    def __init__(self, net: nn.Module) -> None:
        self.net = net.requires_grad_(False).eval()

    def __deepcopy__(self, memo: dict[int, Any]) -> SharedNet:
        return self

    def __call__(self, *inputs: torch.Tensor) -> torch.Tensor:
        device = inputs[0].device
        if next(self.net.buffers()).device != device:
            self.net.to(device)
        return self.net(*inputs)
