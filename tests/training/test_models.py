"""The built-in networks behind --model: shapes, widths and layouts, the VAE bottleneck, the
loss choice, model flag mistakes, the quality metrics validation logs, the startup line that
describes the model."""

from __future__ import annotations

import math

import pytest
import torch

from ae.data.decoding.decode import InputSpec
from ae.training.model import kl_divergence
from ae.training.models import ModelError
from ae.training.position import checkpoint_read
from ae.training.quality import QualityMetrics, ssim_kernel
from ae.training.startup_header import describe
from tests.support.runs import ROOT
from tests.training.model_building import IMAGE, VECTOR, build


@pytest.mark.parametrize(
    ("spec", "flags", "latent"),
    [
        (VECTOR, {}, (16,)),  # auto -> mlp
        (VECTOR, {"hidden_dims": (32, 16, 8), "latent_dim": 4}, (4,)),
        (IMAGE, {}, (16,)),  # auto -> conv
        (InputSpec("image", (3, 7, 7)), {"model": "conv"}, (16,)),  # odd: no stride-2 stage
        (InputSpec("image", (1, 4, 6)), {"model": "conv"}, (16,)),  # tiny: none either
        (IMAGE, {"model": "resnet", "base_channels": 8}, (4, 4, 4)),  # f=8
        (IMAGE, {"model": "resnet", "base_channels": 8, "downsample": 2, "latent_channels": 3},
         (3, 16, 16)),
        (IMAGE, {"model": "resnet", "base_channels": 8, "downsample": 16,
                 "channel_mult": (1, 1, 2, 2, 2)}, (4, 2, 2)),
        (IMAGE, {"model": "resnet", "base_channels": 8, "kl_weight": 1e-3}, (4, 4, 4)),
    ],
)  # fmt: skip
def test_every_builtin_model_reconstructs_the_input_shape(spec, flags, latent) -> None:
    model, shape = build(spec, **flags)
    assert shape == latent
    x = torch.rand(3, *spec.shape)
    assert model.encode(x).shape == (3, *latent)
    assert model(x).shape == x.shape
    loss, recon, _ = model._step(x)
    loss.backward()  # every parameter gets a gradient: nothing is left out of the graph
    assert all(p.grad is not None for p in model.parameters())
    assert recon is not None and recon.shape == x.shape


def test_hidden_dims_set_the_mlp_widths() -> None:
    model, _ = build(VECTOR, hidden_dims=(40, 20), latent_dim=5)
    widths = [m.out_features for m in model.encoder if isinstance(m, torch.nn.Linear)]
    assert widths == [40, 20, 5]
    default, _ = build(VECTOR, hidden_dim=64)  # hidden_dim alone, as before --hidden_dims
    assert [m.out_features for m in default.encoder if hasattr(m, "out_features")] == [64, 32, 16]


def test_resnet_has_groupnorm_residual_blocks_and_the_widths_asked_for() -> None:
    model, _ = build(IMAGE, model="resnet", base_channels=8, channel_mult=(1, 2, 4, 4))
    kinds = {type(m).__name__ for m in model.encoder.modules()}
    assert {"ResBlock", "GroupNorm", "SiLU"} <= kinds
    convs = [m for m in model.encoder if isinstance(m, torch.nn.Conv2d) and m.stride == (2, 2)]
    assert [c.out_channels for c in convs] == [8, 16, 32]  # 3 stride-2 stages for f=8
    assert model.decoder[-1].out_channels == 3


def test_the_conv_default_keeps_the_layout_of_old_checkpoints() -> None:
    """The pre-layout fixture (hidden_dim=8, latent_dim=4, 8x8 digits) loads into today's
    `--model=auto` with the same flags: same keys, same shapes."""
    ckpt = checkpoint_read.load(ROOT / "tests/fixtures/pre_layout_step3.ckpt")  # the safe loader
    spec = ckpt["hyper_parameters"]["spec"]
    model, _ = build(spec, hidden_dim=8, latent_dim=4)
    model.load_state_dict(ckpt["state_dict"])  # strict: raises on any difference


def test_vae_samples_in_training_and_uses_the_mean_in_evaluation() -> None:
    model, _ = build(IMAGE, model="resnet", base_channels=8, kl_weight=0.5)
    x = torch.rand(2, *IMAGE.shape)
    assert model.encoder(x).shape[1] == 8  # mean and log-variance of 4 channels
    model.train()
    torch.manual_seed(0)
    a = model._step(x)[1]
    b = model._step(x)[1]
    assert not torch.equal(a, b)  # a new latent sample each time
    model.eval()
    loss, recon, logs = model._step(x)
    assert torch.equal(recon, model(x))  # the mean: deterministic, what encode() gives
    assert set(logs) == {"recon", "kl"}
    assert loss.item() == pytest.approx((logs["recon"] + 0.5 * logs["kl"]).item())


def test_kl_divergence_is_zero_at_the_prior_and_positive_elsewhere() -> None:
    zero = torch.zeros(2, 4)
    assert kl_divergence(zero, zero).item() == 0.0
    # KL(N(1, 1) || N(0, 1)) = 1/2 per element
    assert kl_divergence(torch.ones(2, 4), zero).item() == pytest.approx(0.5)


@pytest.mark.parametrize("loss", ["mse", "l1", "smooth_l1"])
def test_loss_choice(loss: str) -> None:
    model, _ = build(VECTOR, loss=loss)
    x = torch.rand(4, 24)
    expected = getattr(torch.nn.functional, f"{loss}_loss")(model(x), x)
    assert model._step(x)[0].item() == pytest.approx(expected.item())


def test_model_flag_mistakes_are_model_errors() -> None:
    with pytest.raises(ModelError, match="resnet needs image samples; these are vectors of 24"):
        build(VECTOR, model="resnet")
    with pytest.raises(ModelError, match="mlp needs vector samples"):
        build(IMAGE, model="mlp")
    with pytest.raises(ModelError, match="downsample: 32x24 images cannot be reduced by 16"):
        build(InputSpec("image", (1, 32, 24)), model="resnet", downsample=16,
              channel_mult=(1, 1, 1, 1, 1))  # fmt: skip
    # the flag that fixes it, with its value (was 'resize the images'): --image_size=36 for f8
    with pytest.raises(
        ModelError,
        match=r"\(H and W must be multiples of it\): "
        r"--image_size=32 or --image_size=40, or a smaller --downsample$",
    ):
        build(InputSpec("image", (3, 36, 36)), model="resnet", downsample=8)  # fmt: skip


def test_quality_metrics_match_their_definitions() -> None:
    metrics = QualityMetrics(InputSpec("image", (1, 16, 16)))
    x = torch.full((4, 1, 16, 16), 0.5)
    metrics.update(x + 0.1, x)  # MSE 0.01 -> PSNR 20 dB
    assert metrics.mse.compute().item() == pytest.approx(0.01, rel=1e-4)
    assert metrics.psnr.compute().item() == pytest.approx(20.0, abs=1e-3)
    assert 0 < metrics.ssim.compute().item() <= 1
    vectors = QualityMetrics(InputSpec("vector", (2,)))
    x = torch.tensor([[3.0, 4.0], [1.0, 0.0]])
    vectors.update(torch.tensor([[3.0, 4.0], [0.0, 2.0]]), x)
    # sample 1: exact (error 0, cosine 1); sample 2: |(-1, 2)| / |(1, 0)| = sqrt 5, cosine 0
    assert vectors.rel_error.compute().item() == pytest.approx(math.sqrt(5) / 2)
    assert vectors.cosine.compute().item() == pytest.approx(0.5)
    assert [ssim_kernel(s, s) for s in (64, 8, 5, 3)] == [11, 11, 9, 5]


def test_validation_logs_the_quality_metrics() -> None:
    model, _ = build(IMAGE, model="resnet", base_channels=8)
    logged: dict[str, object] = {}
    model.log = lambda name, value, **kw: logged.setdefault(name, value)  # type: ignore[method-assign]
    model.validation_step(torch.rand(2, *IMAGE.shape), 0)
    assert {"val/loss", "val/mse", "val/psnr", "val/ssim"} <= set(logged)


def test_state_dict_holds_no_metric_state() -> None:
    model, _ = build(IMAGE)
    assert not [k for k in model.state_dict() if k.startswith("quality")]


def test_describe_names_the_model_its_size_and_latent() -> None:
    model, latent = build(IMAGE, model="resnet", base_channels=8, kl_weight=0.1)
    text = describe(model, IMAGE, latent)
    n = sum(p.numel() for p in model.parameters())
    assert text == (
        f"Model: resnet, {n:,} parameters, latent 4x4x4 (64 numbers, 48x fewer than the input),"
        " VAE (kl_weight 0.1)"
    )
    # A latent as large as the input, or larger, compresses nothing: said so, not "0.5x fewer"
    for dim, said in ((24, "(24 numbers, as many as the input: no compression)"),
                      (48, "(48 numbers, 2x more than the input: no compression)")):  # fmt: skip
        model, latent = build(VECTOR, model="mlp", latent_dim=dim)
        assert said in describe(model, VECTOR, latent)
