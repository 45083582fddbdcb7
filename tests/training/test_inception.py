"""The FID Inception v3 loaded through the real loader from a file in pytorch-fid's format (a
random one made here): every tensor of the file in the network, 2048-d features of any image
size, in float32 under autocast too; a wrong file is one message naming it and what it should be.

That the network computes what pytorch-fid's does was checked against pytorch-fid 0.3.0 itself
(with torchvision 0.28.0, not installable beside ae's torch): the same random file in both,
identical features (max abs difference 0.0), and 0.11 apart with Mixed_7c's max pool made an
average pool, the one thing that tells the FID variant's last block from torchvision's."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch.nn import functional as F

from ae.training.inception import FEATURES, FID_FILE, FID_URL, FIDInception, load_inception
from ae.training.state_dict_file import WeightsFileError
from tests.support.inception_weights import INCEPTION_CONVS, random_inception
from tests.support.weights import save


@pytest.fixture(scope="module")
def fid_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save(random_inception(), tmp_path_factory.mktemp("fid") / FID_FILE)


@pytest.fixture(scope="module")
def net(fid_file: Path) -> FIDInception:
    return load_inception(fid_file)


@pytest.fixture(scope="module")
def images() -> torch.Tensor:
    """Two images of an odd size: a colour one and a grey one (its channel three times)."""
    x = torch.rand(2, 3, 40, 52, generator=torch.Generator().manual_seed(3))
    x[1] = x[1, :1]
    return x


@pytest.fixture(scope="module")
def seen(net: FIDInception, images: torch.Tensor) -> dict[str, torch.Tensor]:
    """The features of `images`, and what the first conv received (a forward pre-hook)."""
    stem: list[torch.Tensor] = []
    hook = net.Conv2d_1a_3x3.register_forward_pre_hook(lambda _m, args: stem.append(args[0]))
    try:
        with torch.no_grad():
            features = net(images)
    finally:
        hook.remove()
    return {"features": features, "stem": stem[0]}


def test_every_tensor_of_the_file_is_in_the_network(fid_file: Path, net: FIDInception) -> None:
    state = torch.load(fid_file, weights_only=True)
    loaded = net.state_dict()
    assert len(INCEPTION_CONVS) == 94
    for key, value in state.items():
        if key.startswith("fc.") or key.endswith("num_batches_tracked"):
            continue  # the classifier is not computed; the count is unused in eval mode
        assert torch.equal(loaded[key], value), key
    assert not [k for k in loaded if not k.endswith("num_batches_tracked") and k not in state]


def test_pool_features_frozen(net: FIDInception, seen: dict[str, torch.Tensor]) -> None:
    features = seen["features"]
    assert features.shape == (2, FEATURES) and features.dtype == torch.float32
    assert torch.isfinite(features).all() and (features >= 0).all()  # a mean of ReLUs
    assert features.std() > 0 and not torch.allclose(features[0], features[1])
    net.train()  # an owner's train() leaves it in eval mode: batch norm on its statistics
    assert not net.training and not any(p.requires_grad for p in net.parameters())


def test_resized_to_299_bilinear_and_scaled_to_minus_one_one(
    images: torch.Tensor, seen: dict[str, torch.Tensor]
) -> None:
    resized = F.interpolate(images, size=(299, 299), mode="bilinear", align_corners=False)
    torch.testing.assert_close(seen["stem"], 2 * resized - 1, rtol=0, atol=0)


def test_one_channel_is_three_and_autocast_is_float32(
    net: FIDInception, images: torch.Tensor, seen: dict[str, torch.Tensor]
) -> None:
    with torch.no_grad():
        torch.testing.assert_close(net(images[1:, :1]), seen["features"][1:])
        with torch.autocast("cpu", dtype=torch.bfloat16):
            mixed = net(images[:1])
    assert mixed.dtype == torch.float32
    torch.testing.assert_close(mixed, seen["features"][:1])


def test_torchvisions_inception_file_is_refused(tmp_path: Path) -> None:
    # the same keys, a 1000-class classifier: other weights, FIDs comparable to no paper's
    path = save(random_inception(classes=1000), tmp_path / "inception_v3_google.pth")
    with pytest.raises(WeightsFileError) as e:
        load_inception(path)
    text = str(e.value)
    assert text.startswith(f"fid_weights: {path} is not the FID Inception v3 state dict")
    assert FID_URL in text and "fc.weight is (1000, 2048), expected (1008, 2048)" in text


def test_another_networks_file_is_named_with_what_it_lacks(tmp_path: Path) -> None:
    path = save({"features.0.weight": torch.zeros(64, 3, 3, 3)}, tmp_path / "vgg16.pth")
    with pytest.raises(WeightsFileError) as e:
        load_inception(path)
    text = e.value.render()
    assert f"{path} is not the FID Inception v3 state dict" in text
    assert "Conv2d_1a_3x3.conv.weight missing" in text and "more" in text
    assert "Traceback" not in text


def test_missing_and_truncated_files_are_named(fid_file: Path, tmp_path: Path) -> None:
    with pytest.raises(WeightsFileError, match=r"fid_weights: no such file: .*nothere\.pth"):
        load_inception(tmp_path / "nothere.pth")
    cut = tmp_path / "cut.pth"
    cut.write_bytes(fid_file.read_bytes()[:200_000])
    with pytest.raises(WeightsFileError, match=r"cut\.pth is not a readable torch weights"):
        load_inception(cut)
