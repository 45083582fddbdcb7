"""LPIPS through the real loading code, on weights files the tests make."""

from __future__ import annotations

import copy
import pickle
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from ae.training.perceptual import (
    LPIPS,
    SharedNet,
    VGG16Features,
    load_lpips,
    vgg16_shapes,
)
from ae.training.state_dict_file import WeightsFileError
from tests.support.weights import HEAD_CHANNELS, VGG16_CONVS, random_heads, random_vgg16, save


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    folder = tmp_path_factory.mktemp("weights")
    return save(random_vgg16(), folder / "vgg16.pth"), save(random_heads(), folder / "vgg.pth")


def reference_lpips(
    x: torch.Tensor, y: torch.Tensor, vgg: dict[str, torch.Tensor], heads: dict[str, torch.Tensor]
) -> torch.Tensor:
    """LPIPS v0.1 written out from the lpips package's code, on the raw tensors of the files:
    [0,1] -> [-1,1] -> ScalingLayer -> VGG16 slices 0-3, 4-8, 9-15, 16-22, 23-29 -> normalize_tensor
    -> squared difference -> 1x1 head -> spatial mean -> sum."""
    shift = torch.tensor([-0.030, -0.088, -0.188]).view(1, 3, 1, 1)
    scale = torch.tensor([0.458, 0.448, 0.450]).view(1, 3, 1, 1)

    def taps(img: torch.Tensor) -> list[torch.Tensor]:
        h = ((2 * img - 1) - shift) / scale
        out = []
        for i in range(30):
            if i in VGG16_CONVS:
                h = F.conv2d(h, vgg[f"features.{i}.weight"], vgg[f"features.{i}.bias"], padding=1)
            elif i in (4, 9, 16, 23):
                h = F.max_pool2d(h, 2, 2)
            else:
                h = F.relu(h)
            if i in (3, 8, 15, 22, 29):
                out.append(h)
        return out

    total = 0
    for k, (a, b) in enumerate(zip(taps(x), taps(y), strict=True)):
        a = a / (torch.sqrt(torch.sum(a**2, dim=1, keepdim=True)) + 1e-10)
        b = b / (torch.sqrt(torch.sum(b**2, dim=1, keepdim=True)) + 1e-10)
        total = total + F.conv2d((a - b) ** 2, heads[f"lin{k}.model.1.weight"]).mean([2, 3])
    return total.flatten()


def test_vgg16_keys_are_torchvisions() -> None:
    expected = {}
    for i, (cout, cin) in VGG16_CONVS.items():
        expected[f"features.{i}.weight"] = (cout, cin, 3, 3)
        expected[f"features.{i}.bias"] = (cout,)
    assert vgg16_shapes() == expected
    assert {k: tuple(v.shape) for k, v in VGG16Features().state_dict().items()} == expected


@pytest.mark.parametrize("legacy", [False, True])
def test_loads_the_files_and_matches_the_reference(tmp_path: Path, legacy: bool) -> None:
    vgg, heads = random_vgg16(), random_heads()
    model = load_lpips(
        save(vgg, tmp_path / "v.pth", legacy=legacy), save(heads, tmp_path / "h.pth", legacy=legacy)
    )
    assert torch.equal(model.net.features[28].bias, vgg["features.28.bias"])
    assert torch.equal(model.lin4.model[1].weight, heads["lin4.model.1.weight"])
    g = torch.Generator().manual_seed(3)
    x, y = torch.rand(3, 3, 20, 18, generator=g), torch.rand(3, 3, 20, 18, generator=g)
    got = model(x, y)
    assert got.shape == (3,)
    torch.testing.assert_close(got, reference_lpips(x, y, vgg, heads), rtol=1e-4, atol=1e-6)


def test_a_distance(files: tuple[Path, Path]) -> None:
    model = load_lpips(*files)
    g = torch.Generator().manual_seed(0)
    x = torch.rand(2, 3, 16, 16, generator=g)
    noisy = (x + 0.2 * torch.randn(x.shape, generator=g)).clamp(0, 1)
    assert torch.allclose(model(x, x), torch.zeros(2))
    assert (model(x, noisy) > 0).all()
    torch.testing.assert_close(model(x, noisy), model(noisy, x))
    # more noise, further away (per sample)
    noisier = (x + 0.5 * torch.randn(x.shape, generator=g)).clamp(0, 1)
    assert (model(x, noisier) > model(x, noisy)).all()


def test_grayscale_is_the_image_repeated(files: tuple[Path, Path]) -> None:
    model = load_lpips(*files)
    x, y = torch.rand(2, 1, 16, 16), torch.rand(2, 1, 16, 16)
    torch.testing.assert_close(model(x, y), model(x.repeat(1, 3, 1, 1), y.repeat(1, 3, 1, 1)))


def test_frozen_but_passes_gradients_to_the_input(files: tuple[Path, Path]) -> None:
    model = load_lpips(*files)
    model.train()  # an owner's .train() must not turn on the heads' dropout
    assert not model.training
    x = torch.rand(2, 3, 16, 16, requires_grad=True)
    a, b = model(x, torch.rand(2, 3, 16, 16)), model(x, torch.rand(2, 3, 16, 16))
    (a.sum() + b.sum()).backward()
    assert x.grad is not None and x.grad.abs().sum() > 0
    assert all(not p.requires_grad and p.grad is None for p in model.parameters())


def test_a_missing_file_is_named(files: tuple[Path, Path], tmp_path: Path) -> None:
    with pytest.raises(WeightsFileError, match=r"no such file: .*nothere\.pth"):
        load_lpips(tmp_path / "nothere.pth", files[1])


def test_a_truncated_file_is_named(files: tuple[Path, Path], tmp_path: Path) -> None:
    cut = tmp_path / "cut.pth"
    cut.write_bytes(files[0].read_bytes()[:100_000])
    with pytest.raises(WeightsFileError, match=r"cut\.pth is not a readable torch weights"):
        load_lpips(cut, files[1])


def test_two_bad_files_are_both_named(tmp_path: Path) -> None:
    """Two bad downloads: one message naming both, so that both are fetched again at once."""
    vgg, heads = tmp_path / "vgg16.pth", tmp_path / "vgg.pth"
    vgg.write_bytes(b"<html>404</html>")
    heads.write_bytes(b"")
    with pytest.raises(WeightsFileError) as err:
        load_lpips(vgg, heads)
    lines = str(err.value).splitlines()
    assert len(lines) == 2 and str(vgg) in lines[0] and str(heads) in lines[1], lines


class Payload:
    def __reduce__(self):  # what a malicious file does: name a callable to run on load
        return (print, ("ran",))


def test_a_file_that_would_run_code_is_refused(files: tuple[Path, Path], tmp_path: Path) -> None:
    bad = tmp_path / "bad.pth"
    torch.save({"features.0.weight": Payload()}, bad, pickle_module=pickle)
    with pytest.raises(WeightsFileError, match=r"bad\.pth is not a readable torch weights") as e:
        load_lpips(bad, files[1])
    # the safe loader's reason, without torch's advice to load it unsafely (ae never does)
    assert "not a file of tensors alone: Unsupported global: GLOBAL print was not" in str(e.value)
    assert "weights_only" not in str(e.value) and "trusted source" not in str(e.value)


def test_a_file_of_garbage_is_named_without_torchs_advice(
    files: tuple[Path, Path], tmp_path: Path
) -> None:
    garbage = tmp_path / "garbage.pth"
    garbage.write_bytes(b"<html>404 Not Found</html>\n")
    with pytest.raises(WeightsFileError) as e:
        load_lpips(garbage, files[1])
    assert str(e.value) == (
        f"perceptual_weights: {garbage} is not a readable torch weights file (not a file of "
        "tensors alone: Unsupported operand 60); a partial download? Fetch it again"
    )


def test_wrong_shapes_and_missing_keys_are_listed(files: tuple[Path, Path], tmp_path: Path) -> None:
    vgg = random_vgg16()
    vgg["features.5.weight"] = torch.zeros(128, 64, 5, 5)
    del vgg["features.28.bias"]
    path = save(vgg, tmp_path / "odd.pth")
    with pytest.raises(WeightsFileError) as e:
        load_lpips(path, files[1])
    text = str(e.value)
    assert "torchvision's VGG16 state dict" in text
    assert "features.5.weight is (128, 64, 5, 5), expected (128, 64, 3, 3)" in text
    assert "features.28.bias missing" in text


def test_the_heads_swapped_for_vgg_is_named(files: tuple[Path, Path]) -> None:
    with pytest.raises(WeightsFileError, match=r"LPIPS v0\.1 VGG heads.*lin0\.model\.1\.weight"):
        load_lpips(files[0], files[0])


def test_negative_heads_are_not_lpips(files: tuple[Path, Path], tmp_path: Path) -> None:
    heads = random_heads()
    heads["lin2.model.1.weight"] = -heads["lin2.model.1.weight"]
    path = save(heads, tmp_path / "neg.pth")
    with pytest.raises(WeightsFileError, match=r"lin2\.model\.1\.weight has negative weights"):
        load_lpips(files[0], path)


def test_head_channels_are_lpips_vgg() -> None:
    assert tuple(getattr(LPIPS(), f"lin{i}").model[1].in_channels for i in range(5)) == (
        HEAD_CHANNELS
    )


class Owner(nn.Module):
    def __init__(self, net: nn.Module) -> None:
        super().__init__()
        self.decoder = nn.Conv2d(3, 3, 1)
        self.lpips = SharedNet(net)


def test_shared_net_is_not_owned(files: tuple[Path, Path]) -> None:
    net = load_lpips(*files)
    owner = Owner(net)
    assert set(owner.state_dict()) == {"decoder.weight", "decoder.bias"}
    assert len(list(owner.parameters())) == 2
    twin = copy.deepcopy(owner)  # what the EMA's AveragedModel does to the module
    assert twin.lpips.net is net
    assert twin.decoder is not owner.decoder
    x = torch.rand(1, 3, 16, 16, dtype=torch.float64)
    net.double()  # the device/dtype move is the caller's; first use moves devices only
    assert owner.lpips(x, x).shape == (1,)
