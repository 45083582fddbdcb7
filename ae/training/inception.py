"""The FID Inception v3 (Szegedy et al. 2016, the 2015-12-05 TensorFlow graph every paper's FID
uses), to its 2048-d pool features: the network of `val/rfid` (`--fid_weights`).

Written here rather than imported: torchvision does not install beside ae's torch, and pytorch-fid
imports it. The file it loads is pytorch-fid's `pt_inception-2015-12-05-6726825d.pth` (the TF
weights ported to torchvision's Inception3 key names: `Conv2d_1a_3x3.conv.weight`, ...
`Mixed_7c.branch_pool.bn.running_var`); its classifier (`fc.*`, 1008 classes) is not needed and
is ignored. What pytorch-fid's `InceptionV3([3])` computes, and this module too:

    x in [0, 1] -> bilinear resize to 299x299 (align_corners=False) -> 2x - 1
    -> torchvision's Inception3 stem and Mixed_5b ... Mixed_7c -> global average pool -> (B, 2048)

with the FID variant's blocks, which differ from torchvision's: the average pools of the A, C and
E blocks leave the padding out of the mean (`count_include_pad=False`), and the last E block
(Mixed_7c) max-pools its pool branch. Convolutions have no bias; each is followed by batch norm
(eps 1e-3, running statistics: always in eval mode) and a ReLU.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn
from torch.nn import functional as F

from ae.config import ObjectiveConfig
from ae.config.weight_files import fid_file
from ae.data.decoding.decode import InputSpec
from ae.log_lines import main_log
from ae.training.models import ModelError
from ae.training.state_dict_file import checked, read_state_dict

FID_FILE = "pt_inception-2015-12-05-6726825d.pth"
FID_URL = f"https://github.com/mseitzer/pytorch-fid/releases/download/fid_weights/{FID_FILE}"
FEATURES = 2048
SIZE = 299
# The TF graph's classifier: 1008 classes (torchvision's own Inception v3 file has 1000). Not
# computed, but checked: it tells the FID weights from torchvision's, whose keys are the same.
CLASSIFIER = {"fc.weight": (1008, FEATURES), "fc.bias": (1008,)}
Kernel = int | tuple[int, int]


class BasicConv2d(nn.Module):
    """torchvision's: conv (no bias) -> batch norm (eps 1e-3) -> ReLU; keys `conv.*`, `bn.*`."""

    def __init__(self, cin: int, cout: int, kernel: Kernel, stride: int = 1, padding: Kernel = 0):
        super().__init__()
        self.conv = nn.Conv2d(cin, cout, kernel, stride=stride, padding=padding, bias=False)
        self.bn = nn.BatchNorm2d(cout, eps=0.001)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(self.bn(self.conv(x)))


def avg_pool(x: torch.Tensor) -> torch.Tensor:
    """The FID blocks' 3x3 pool branch: the mean over the window's real pixels only."""
    return F.avg_pool2d(x, 3, stride=1, padding=1, count_include_pad=False)


class InceptionA(nn.Module):
    """Mixed_5b/c/d (FIDInceptionA): 64 + 64 + 96 + `pool` channels."""

    def __init__(self, cin: int, pool: int) -> None:
        super().__init__()
        self.branch1x1 = BasicConv2d(cin, 64, 1)
        self.branch5x5_1 = BasicConv2d(cin, 48, 1)
        self.branch5x5_2 = BasicConv2d(48, 64, 5, padding=2)
        self.branch3x3dbl_1 = BasicConv2d(cin, 64, 1)
        self.branch3x3dbl_2 = BasicConv2d(64, 96, 3, padding=1)
        self.branch3x3dbl_3 = BasicConv2d(96, 96, 3, padding=1)
        self.branch_pool = BasicConv2d(cin, pool, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b5 = self.branch5x5_2(self.branch5x5_1(x))
        b3 = self.branch3x3dbl_3(self.branch3x3dbl_2(self.branch3x3dbl_1(x)))
        return torch.cat([self.branch1x1(x), b5, b3, self.branch_pool(avg_pool(x))], 1)


class InceptionB(nn.Module):
    """Mixed_6a (torchvision's, unchanged): the grid 35 -> 17."""

    def __init__(self, cin: int) -> None:
        super().__init__()
        self.branch3x3 = BasicConv2d(cin, 384, 3, stride=2)
        self.branch3x3dbl_1 = BasicConv2d(cin, 64, 1)
        self.branch3x3dbl_2 = BasicConv2d(64, 96, 3, padding=1)
        self.branch3x3dbl_3 = BasicConv2d(96, 96, 3, stride=2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b3 = self.branch3x3dbl_3(self.branch3x3dbl_2(self.branch3x3dbl_1(x)))
        return torch.cat([self.branch3x3(x), b3, F.max_pool2d(x, 3, stride=2)], 1)


class InceptionC(nn.Module):
    """Mixed_6b/c/d/e (FIDInceptionC): factorised 7x7 convolutions, 4 x 192 channels."""

    def __init__(self, cin: int, c7: int) -> None:
        super().__init__()
        self.branch1x1 = BasicConv2d(cin, 192, 1)
        self.branch7x7_1 = BasicConv2d(cin, c7, 1)
        self.branch7x7_2 = BasicConv2d(c7, c7, (1, 7), padding=(0, 3))
        self.branch7x7_3 = BasicConv2d(c7, 192, (7, 1), padding=(3, 0))
        self.branch7x7dbl_1 = BasicConv2d(cin, c7, 1)
        self.branch7x7dbl_2 = BasicConv2d(c7, c7, (7, 1), padding=(3, 0))
        self.branch7x7dbl_3 = BasicConv2d(c7, c7, (1, 7), padding=(0, 3))
        self.branch7x7dbl_4 = BasicConv2d(c7, c7, (7, 1), padding=(3, 0))
        self.branch7x7dbl_5 = BasicConv2d(c7, 192, (1, 7), padding=(0, 3))
        self.branch_pool = BasicConv2d(cin, 192, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b7 = self.branch7x7_3(self.branch7x7_2(self.branch7x7_1(x)))
        dbl = x
        for i in range(1, 6):
            dbl = getattr(self, f"branch7x7dbl_{i}")(dbl)
        return torch.cat([self.branch1x1(x), b7, dbl, self.branch_pool(avg_pool(x))], 1)


class InceptionD(nn.Module):
    """Mixed_7a (torchvision's, unchanged): the grid 17 -> 8."""

    def __init__(self, cin: int) -> None:
        super().__init__()
        self.branch3x3_1 = BasicConv2d(cin, 192, 1)
        self.branch3x3_2 = BasicConv2d(192, 320, 3, stride=2)
        self.branch7x7x3_1 = BasicConv2d(cin, 192, 1)
        self.branch7x7x3_2 = BasicConv2d(192, 192, (1, 7), padding=(0, 3))
        self.branch7x7x3_3 = BasicConv2d(192, 192, (7, 1), padding=(3, 0))
        self.branch7x7x3_4 = BasicConv2d(192, 192, 3, stride=2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b3 = self.branch3x3_2(self.branch3x3_1(x))
        b7 = x
        for i in range(1, 5):
            b7 = getattr(self, f"branch7x7x3_{i}")(b7)
        return torch.cat([b3, b7, F.max_pool2d(x, 3, stride=2)], 1)


class InceptionE(nn.Module):
    """Mixed_7b (FIDInceptionE_1: average pool) and Mixed_7c (FIDInceptionE_2: max pool, the TF
    graph's quirk): 320 + 768 + 768 + 192 = 2048 channels."""

    def __init__(self, cin: int, max_pool: bool) -> None:
        super().__init__()
        self.max_pool = max_pool
        self.branch1x1 = BasicConv2d(cin, 320, 1)
        self.branch3x3_1 = BasicConv2d(cin, 384, 1)
        self.branch3x3_2a = BasicConv2d(384, 384, (1, 3), padding=(0, 1))
        self.branch3x3_2b = BasicConv2d(384, 384, (3, 1), padding=(1, 0))
        self.branch3x3dbl_1 = BasicConv2d(cin, 448, 1)
        self.branch3x3dbl_2 = BasicConv2d(448, 384, 3, padding=1)
        self.branch3x3dbl_3a = BasicConv2d(384, 384, (1, 3), padding=(0, 1))
        self.branch3x3dbl_3b = BasicConv2d(384, 384, (3, 1), padding=(1, 0))
        self.branch_pool = BasicConv2d(cin, 192, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b3 = self.branch3x3_1(x)
        b3 = torch.cat([self.branch3x3_2a(b3), self.branch3x3_2b(b3)], 1)
        dbl = self.branch3x3dbl_2(self.branch3x3dbl_1(x))
        dbl = torch.cat([self.branch3x3dbl_3a(dbl), self.branch3x3dbl_3b(dbl)], 1)
        pooled = F.max_pool2d(x, 3, stride=1, padding=1) if self.max_pool else avg_pool(x)
        return torch.cat([self.branch1x1(x), b3, dbl, self.branch_pool(pooled)], 1)


class FIDInception(nn.Module):
    """Images in [0, 1] (B, 3, H, W), any size (resized to 299) -> pool features (B, 2048), in
    float32. One-channel images are repeated to three. Always frozen, in eval mode."""

    def __init__(self) -> None:
        super().__init__()
        self.Conv2d_1a_3x3 = BasicConv2d(3, 32, 3, stride=2)
        self.Conv2d_2a_3x3 = BasicConv2d(32, 32, 3)
        self.Conv2d_2b_3x3 = BasicConv2d(32, 64, 3, padding=1)
        self.Conv2d_3b_1x1 = BasicConv2d(64, 80, 1)
        self.Conv2d_4a_3x3 = BasicConv2d(80, 192, 3)
        self.Mixed_5b = InceptionA(192, pool=32)
        self.Mixed_5c = InceptionA(256, pool=64)
        self.Mixed_5d = InceptionA(288, pool=64)
        self.Mixed_6a = InceptionB(288)
        self.Mixed_6b = InceptionC(768, c7=128)
        self.Mixed_6c = InceptionC(768, c7=160)
        self.Mixed_6d = InceptionC(768, c7=160)
        self.Mixed_6e = InceptionC(768, c7=192)
        self.Mixed_7a = InceptionD(768)
        self.Mixed_7b = InceptionE(1280, max_pool=False)
        self.Mixed_7c = InceptionE(2048, max_pool=True)
        self.requires_grad_(False)
        self.eval()

    def train(self, mode: bool = True) -> FIDInception:
        return super().train(False)  # batch norm on its running statistics, whatever the owner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # In float32 under --precision=bf16-mixed too: the features every FID is computed on.
        with torch.autocast(x.device.type, enabled=False):
            return self.features(x.float())

    def features(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[1] == 1:
            x = x.expand(-1, 3, -1, -1)
        x = F.interpolate(x, size=(SIZE, SIZE), mode="bilinear", align_corners=False)
        x = 2 * x - 1
        x = self.Conv2d_2b_3x3(self.Conv2d_2a_3x3(self.Conv2d_1a_3x3(x)))
        x = F.max_pool2d(x, 3, stride=2)
        x = F.max_pool2d(self.Conv2d_4a_3x3(self.Conv2d_3b_1x1(x)), 3, stride=2)
        for name in ("5b", "5c", "5d", "6a", "6b", "6c", "6d", "6e", "7a", "7b", "7c"):
            x = getattr(self, f"Mixed_{name}")(x)
        return x.mean(dim=(2, 3))


def inception_shapes() -> dict[str, tuple[int, ...]]:
    """{key: shape} of every tensor the FID file must hold: each conv's weight and its batch
    norm's weight, bias, running mean and variance (`num_batches_tracked` is not needed in eval
    mode, and the ported file need not have it), and the 1008-class classifier."""
    net = {
        k: tuple(v.shape)
        for k, v in FIDInception().state_dict().items()
        if not k.endswith("num_batches_tracked")
    }
    return {**net, **CLASSIFIER}


def load_inception(path: Path) -> FIDInception:
    """The FID Inception with pytorch-fid's weights file at `path`, frozen, on the CPU. Raises
    WeightsFileError naming the file when it is not that file."""
    state = checked(
        read_state_dict(path, "fid_weights"), inception_shapes(), path, "fid_weights",
        f"the FID Inception v3 state dict (pytorch-fid's {FID_FILE} from {FID_URL})",
    )  # fmt: skip
    for key in CLASSIFIER:
        del state[key]
    model = FIDInception()
    model.load_state_dict(state, strict=False)  # all but num_batches_tracked, checked above
    return model


def load_fid(cfg: ObjectiveConfig, spec: InputSpec) -> FIDInception | None:
    """The FID Inception of `--fid_weights` when it is set (the launcher checked the file
    exists; a wrong one is a WeightsFileError naming it); a ModelError for data it cannot
    measure."""
    if not cfg.fid_weights:
        return None
    if spec.kind != "image" or spec.shape[0] not in (1, 3):
        raise ModelError(
            f"fid_weights: rFID is for images of 1 or 3 channels; these are {spec.kind}s of "
            f"shape {spec.shape}"
        )
    path = fid_file(cfg.fid_weights)
    net = load_inception(path)
    main_log.info(f"FID Inception v3 from {path}: val/rfid at each validation")
    return net
