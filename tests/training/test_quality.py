"""`val/rfid` wired into validation: the Frechet distance between the features of the validation
images and of their clamped reconstructions, over the whole set, logged by Lightning at the
epoch's end; the feature network kept out of the model's state; `--fid_weights` refused for data
rFID cannot measure. The features here come from a small fixed network (the FID Inception's own
tests are tests/training/test_inception.py; the whole path, tests/e2e/test_image_recipe.py)."""

from __future__ import annotations

from pathlib import Path

import lightning as L
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader

from ae.config import ModelConfig, ObjectiveConfig
from ae.data.decoding.decode import InputSpec
from ae.training.frechet import frechet_distance, moments
from ae.training.inception import load_fid
from ae.training.model import AutoEncoder
from ae.training.models import ModelError

SPEC = InputSpec("image", (3, 8, 8))


class Projection(nn.Module):
    """Images -> 6 fixed random features (with a buffer, as SharedNet moves a net by them)."""

    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(5)
        self.register_buffer("w", torch.randn(3 * 8 * 8, 6, generator=g))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x.flatten(1) @ self.w)


def test_val_rfid_is_the_distance_of_the_whole_validation_set() -> None:
    torch.manual_seed(0)
    m = AutoEncoder(SPEC, ModelConfig(model="conv", hidden_dim=8, latent_dim=4))
    m.attach_fid(Projection(), features=6)
    images = torch.rand(24, *SPEC.shape, generator=torch.Generator().manual_seed(1))
    t = L.Trainer(accelerator="cpu", logger=False, enable_progress_bar=False,
                  enable_model_summary=False)  # fmt: skip
    (metrics,) = t.validate(m, DataLoader(images, batch_size=5), verbose=False)
    # by hand: all 24 images and reconstructions at once
    net = Projection()
    with torch.no_grad():
        real = net(images).double()
        fake = net(m(images).clamp(0, 1)).double()
    expected = frechet_distance(
        *moments(real.sum(0), real.T @ real, 24), *moments(fake.sum(0), fake.T @ fake, 24)
    )
    assert expected > 1e-3
    assert metrics["val/rfid"] == pytest.approx(expected, rel=1e-5)
    assert {"val/psnr", "val/ssim", "val/loss"} <= set(metrics)
    # the feature network and the sums are not the model's: no checkpoint carries them
    assert not [k for k in m.state_dict() if "rfid" in k or "fid_net" in k or k.endswith(".w")]


def test_without_fid_weights_nothing_is_loaded() -> None:
    assert load_fid(ObjectiveConfig(), SPEC) is None


@pytest.mark.parametrize(
    ("spec", "said"),
    [(InputSpec("vector", (16,)), "vectors of shape (16,)"),
     (InputSpec("image", (4, 8, 8)), "images of shape (4, 8, 8)")],
)  # fmt: skip
def test_rfid_is_refused_for_data_it_cannot_measure(
    spec: InputSpec, said: str, tmp_path: Path
) -> None:
    with pytest.raises(ModelError, match=r"fid_weights: rFID is for images of 1 or 3 channels"):
        load_fid(ObjectiveConfig(fid_weights=str(tmp_path / "x.pth")), spec)
    with pytest.raises(ModelError) as e:
        load_fid(ObjectiveConfig(fid_weights=str(tmp_path / "x.pth")), spec)
    assert said in str(e.value)


class CountingProjection(Projection):
    """`Projection`, counting the images it is given."""

    def __init__(self) -> None:
        super().__init__()
        self.images = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.images += len(x)
        return super().forward(x)


def _by_hand_rfid(m: AutoEncoder, images: torch.Tensor) -> float:
    net = Projection()
    with torch.no_grad():
        real = net(images).double()
        fake = net(m(images).clamp(0, 1)).double()
    n = len(images)
    return frechet_distance(
        *moments(real.sum(0), real.T @ real, n), *moments(fake.sum(0), fake.T @ fake, n)
    )


def test_the_validation_images_features_are_computed_once() -> None:
    """The second validation of the same images passes only the reconstructions through the
    feature network, and gives the distance of a fresh computation; other images are computed."""
    torch.manual_seed(0)
    m = AutoEncoder(SPEC, ModelConfig(model="conv", hidden_dim=8, latent_dim=4))
    net = CountingProjection()
    m.attach_fid(net, features=6)
    gen = torch.Generator().manual_seed(1)
    images, others = torch.rand(24, *SPEC.shape, generator=gen), torch.rand(10, *SPEC.shape)
    t = L.Trainer(accelerator="cpu", logger=False, enable_progress_bar=False,
                  enable_model_summary=False)  # fmt: skip

    def validate(data: torch.Tensor) -> float:
        (metrics,) = t.validate(m, DataLoader(data, batch_size=5), verbose=False)
        return metrics["val/rfid"]

    first = validate(images)
    assert net.images == 48  # images and reconstructions
    with torch.no_grad():  # the model moves on between validations
        for p in m.parameters():
            p.add_(0.01)
    second = validate(images)
    assert net.images == 48 + 24  # the reconstructions only
    assert second != first and second == pytest.approx(_by_hand_rfid(m, images), rel=1e-5)
    assert validate(others) == pytest.approx(_by_hand_rfid(m, others), rel=1e-5)
    assert net.images == 48 + 24 + 20
