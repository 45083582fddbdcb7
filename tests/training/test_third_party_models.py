"""Third-party networks behind --model: the output layouts of diffusers' AutoencoderKL
(tests/support/strided_autoencoder.py reproduces them) pass the check and validation, a
decode that returns no tensor and a model that would fail in validation are model errors
before training, and docs/TRAINING.md's diffusers adapter builds and validates."""

from __future__ import annotations

import pytest
import torch

from ae.config import ModelConfig, OptimConfig
from ae.data.decoding.decode import InputSpec
from ae.training.model import AutoEncoder
from ae.training.model_build import build_model, latent_shape
from ae.training.models import ModelError
from ae.training.quality import QualityMetrics
from tests.support.runs import ROOT

STRIDED = "tests.support.strided_autoencoder"
RGB8 = InputSpec("image", (3, 8, 8))


def test_third_party_output_layouts_pass_the_check_and_validation() -> None:
    """A channels-last float16 latent and a permuted (non-contiguous) reconstruction, as
    diffusers' AutoencoderKL hands back: the check on a real batch and validation accept them."""
    x = torch.rand(2, *RGB8.shape)
    model, latent = build_model(
        RGB8, ModelConfig(model=f"{STRIDED}:StridedAutoEncoder"), OptimConfig(), 1, batch=x
    )
    assert latent == (4, 4, 4)
    assert not model.decode(model.encode(x)).is_contiguous()  # the layout under test
    logged: dict[str, object] = {}
    model.log = lambda name, value, **kw: logged.setdefault(name, value)  # type: ignore[method-assign]
    model.validation_step(x, 0)
    assert model.quality.mse.compute() > 0 and {"val/psnr", "val/ssim"} <= set(logged)
    metrics = QualityMetrics(RGB8)
    channels_last = x.contiguous(memory_format=torch.channels_last).to(torch.bfloat16)
    metrics.update(channels_last, x)
    assert metrics.mse.compute().item() < 1e-4  # bfloat16 rounding only


class _Output:
    pass


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("dataclass", "decode returned DecoderOutput; return its .sample"),
        ("tuple", r"decode returned tuple; return its \[0\]"),
        ("dict", r"decode returned dict; return its \['sample'\]"),
        ("object", "decode returned _Output; return a torch.Tensor"),
    ],
)
def test_a_decode_that_returns_no_tensor_is_one_model_error(
    value: str, message: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tests.support.strided_autoencoder import DecoderOutput, StridedAutoEncoder

    wrap = {
        "dataclass": DecoderOutput,
        "tuple": lambda t: (t,),
        "dict": lambda t: {"sample": t},
        "object": lambda t: _Output(),
    }[value]
    plain = StridedAutoEncoder.decode
    monkeypatch.setattr(StridedAutoEncoder, "decode", lambda self, z: wrap(plain(self, z)))
    with pytest.raises(ModelError, match=f"^model: {message}$") as err:
        build_model(RGB8, ModelConfig(model=f"{STRIDED}:StridedAutoEncoder"), OptimConfig(), 1)
    assert err.value.exit_code == 2


def test_a_model_that_would_fail_in_validation_fails_the_check() -> None:
    """The check computes the loss and metrics validation computes, on the real batch."""

    class LossNeedsLabels(torch.nn.Module):
        def encode(self, x: torch.Tensor) -> torch.Tensor:
            return x

        def decode(self, z: torch.Tensor) -> torch.Tensor:
            return z

        def loss(self, x: torch.Tensor) -> tuple[torch.Tensor, dict]:
            raise ValueError("loss() needs labels")

    model = AutoEncoder(RGB8, ModelConfig(), OptimConfig(), net=LossNeedsLabels())
    with pytest.raises(ModelError, match=r"validation metrics fail on a batch of \(2, 3, 8, 8\)"):
        latent_shape(model, RGB8, torch.rand(2, *RGB8.shape))
    assert latent_shape(model, RGB8) == (3, 8, 8)  # a dummy batch: the shape check only


def test_the_documented_diffusers_adapter_builds_and_validates() -> None:
    """docs/TRAINING.md's AutoencoderKL adapter (tests/support/diffusers_vae.py)."""
    pytest.importorskip("diffusers")
    spec = InputSpec("image", (3, 32, 32))
    x = torch.rand(2, *spec.shape)
    cfg = ModelConfig(model="tests.support.diffusers_vae:DiffusersVAE", model_args={"widths": [32]})
    model, latent = build_model(spec, cfg, OptimConfig(), world_size=1, batch=x)
    assert latent == (4, 32, 32)  # one block: no downsampling
    logged: dict[str, object] = {}
    model.log = lambda name, value, **kw: logged.setdefault(name, value)  # type: ignore[method-assign]
    model.validation_step(x, 0)
    assert {"val/loss", "val/l1", "val/kl", "val/psnr", "val/ssim"} <= set(logged)
    readme = (ROOT / "docs" / "TRAINING.md").read_text()
    assert (ROOT / "tests" / "support" / "diffusers_vae.py").read_text() in readme
