"""The networks behind --model: shapes, the VAE bottleneck, quality metrics, user classes."""

from __future__ import annotations

import math
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from ae.config import ConfigError, ModelConfig, OptimConfig, parse_config
from ae.config.model_path import locate_class
from ae.data.decoding.decode import InputSpec
from ae.training.model import AutoEncoder, kl_divergence
from ae.training.model_build import build_model, latent_shape
from ae.training.models import ModelError
from ae.training.position import checkpoint_read
from ae.training.quality import QualityMetrics, ssim_kernel
from ae.training.startup_header import describe
from tests.support.runs import ROOT

IMAGE = InputSpec("image", (3, 32, 32))
VECTOR = InputSpec("vector", (24,))


def build(spec: InputSpec, **flags: object) -> tuple[AutoEncoder, tuple[int, ...] | None]:
    return build_model(spec, ModelConfig(**flags), OptimConfig(), world_size=1)


@pytest.mark.parametrize(
    ("spec", "flags", "latent"),
    [
        (VECTOR, {}, (16,)),  # auto -> mlp
        (VECTOR, {"hidden_dims": (32, 16, 8), "latent_dim": 4}, (4,)),
        (IMAGE, {}, (16,)),  # auto -> conv
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


# --- your own class ------------------------------------------------------------------------
USER_MODULE = """
import torch
from torch import nn
import lightning as L

class Flat(nn.Module):
    def __init__(self, input_shape, latent=3):
        super().__init__()
        self.input_shape = input_shape
        self.enc = nn.Linear(input_shape[0], latent)
        self.dec = nn.Linear(latent, input_shape[0])
    def encode(self, x):
        return self.enc(x)
    def decode(self, z):
        return self.dec(z)

class Halves(Flat):
    def __init__(self, input_shape):
        super().__init__(input_shape)
        self.encoder, self.decoder = self.enc, self.dec

class WrongShape(Flat):
    def decode(self, z):
        return z

class NoDecode(nn.Module):
    def encode(self, x):
        return x

class Lit(L.LightningModule):
    def __init__(self, width=2):
        super().__init__()
        self.width = width

class NeedsArgs(Flat):
    def __init__(self, input_shape, depth, width, act="relu"):
        super().__init__(input_shape)

NOT_A_CLASS = 3
"""


@pytest.fixture
def user_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """`mypkg.models` in a package of the working directory, as a user would have it."""
    pkg = tmp_path / "mypkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("raise RuntimeError('a package __init__ that runs')\n")
    (pkg / "models.py").write_text(USER_MODULE)
    (tmp_path / "flatmods.py").write_text(USER_MODULE)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))
    for name in ("flatmods", "mypkg", "mypkg.models"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    return "flatmods"


def test_locate_class_finds_module_and_name_without_running_them(user_module: str) -> None:
    # mypkg/__init__.py raises when run: locating never runs it
    assert locate_class("mypkg.models:Flat") is None
    assert locate_class("mypkg.models:NOT_A_CLASS") is None  # bound: load_class tells the rest
    assert "no module 'mypkg.nope'" in (locate_class("mypkg.nope:Flat") or "")
    assert "no module 'nowhere'" in (locate_class("nowhere:X") or "")
    assert "defines no 'Flta'; did you mean mypkg.models:Flat?" in (
        locate_class("mypkg.models:Flta") or ""
    )
    assert "did you mean mypkg.models:Flat?" in (locate_class("mypkg.models:flat") or "")
    assert locate_class("flatmods.py:Flat") == (
        "model: 'flatmods.py' is a file name; name its module: --model=flatmods:Flat"
    )


def test_a_model_value_of_the_wrong_form_says_what_it_probably_meant() -> None:
    hints = {}
    for value in ("resnt", "mypkg.models.Flat", "/home/me/flatmods.py:Flat", "nothing"):
        with pytest.raises(ConfigError) as err:
            parse_config([f"--model={value}"])
        (hints[value],) = err.value.problems
    assert hints["resnt"].endswith("got 'resnt' (did you mean resnet?)")
    assert "(did you mean --model=mypkg.models:Flat? a colon" in hints["mypkg.models.Flat"]
    assert "--model=flatmods:Flat)" in hints["/home/me/flatmods.py:Flat"]
    assert hints["nothing"].endswith("got 'nothing'")


def test_user_nn_module_is_wrapped_with_input_shape_and_model_args(user_module: str) -> None:
    model, latent = build(VECTOR, model="flatmods:Flat", model_args={"latent": 5})
    assert isinstance(model, AutoEncoder) and latent == (5,)
    assert model.net.input_shape == (24,)
    model._trainer = SimpleNamespace(estimated_stepping_batches=10, is_global_zero=False)
    groups = model.configure_optimizers()["optimizer"].param_groups
    assert [g["name"] for g in groups] == ["model"]  # no encoder/decoder attributes
    halves, _ = build(VECTOR, model="flatmods:Halves")
    halves._trainer = model._trainer
    groups = halves.configure_optimizers()["optimizer"].param_groups
    assert [g["name"] for g in groups] == ["encoder", "decoder"]


def test_user_lightning_module_is_used_as_it_is(user_module: str) -> None:
    model, latent = build(VECTOR, model="flatmods:Lit", model_args={"width": 7})
    assert type(model).__name__ == "Lit" and model.width == 7 and latent is None
    with pytest.raises(ModelError, match="compiles itself"):
        build(VECTOR, model="flatmods:Lit", compile=True)


@pytest.mark.parametrize(
    ("path", "args", "message"),
    [
        ("mypkg.models:Flat", None, "cannot import mypkg.models: RuntimeError: a package"),
        ("flatmods:NOT_A_CLASS", None, "flatmods:NOT_A_CLASS: a int, not a class"),
        (
            "flatmods:Flat",
            {"latnet": 2},
            "failed: TypeError: .*unexpected keyword argument.*; it takes input_shape, latent "
            r"\(did you mean latent\?\)$",
        ),
        ("flatmods:NoDecode", None, "must be a LightningModule, or an nn.Module with encode"),
        (  # the arguments its constructor needs, as the flag that gives them
            "flatmods:NeedsArgs",
            {"depth": 2},
            r"missing 1 required positional argument: 'width'; give them with "
            r"--model_args='\{depth: 2, width: \.\.\.\}'$",
        ),
        ("flatmods:WrongShape", None, r"decode\(encode\(x\)\) gives \(2, 3\) for x of \(2, 24\)"),
    ],
)
def test_user_class_that_cannot_be_used_is_one_model_error(
    user_module: str, path: str, args: dict | None, message: str
) -> None:
    with pytest.raises(ModelError, match=message):
        build(VECTOR, model=path, model_args=args)


def test_lr_multipliers_need_encoder_and_decoder(user_module: str) -> None:
    model = build_model(VECTOR, ModelConfig(model="flatmods:Flat"),
                        OptimConfig(encoder_lr_mult=0.5), world_size=1)[0]  # fmt: skip
    model._trainer = SimpleNamespace(estimated_stepping_batches=10, is_global_zero=False)
    with pytest.raises(ModelError, match="no `encoder` and `decoder` submodules"):
        model.configure_optimizers()


def test_the_documented_example_class_builds_for_vectors_and_images() -> None:
    for spec in (VECTOR, IMAGE):
        model, latent = build(spec, model="tests.support.my_autoencoder:TinyAutoEncoder")
        assert latent == (8,)
        loss, recon, logs = model._step(torch.rand(2, *spec.shape))
        assert recon is None and set(logs) == {"recon"} and loss > logs["recon"]


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


def test_no_step_value_becomes_a_python_number_without_a_progress_bar() -> None:
    """Lightning turns every prog_bar value into a Python number after every batch (a host sync
    per step on a GPU, found by bench/gpu_proof on an H200): without a progress bar nothing of
    ae's is put on it, and with one the step loss is."""
    import lightning as L
    import torch
    from torch.utils.data import DataLoader

    data = DataLoader(torch.rand(64, 24), batch_size=8)
    for bar in (False, True):
        model, _ = build(VECTOR)
        trainer = L.Trainer(
            accelerator="cpu", max_steps=6, log_every_n_steps=1, logger=False,
            enable_checkpointing=False, enable_progress_bar=bar, enable_model_summary=False,
        )  # fmt: skip
        trainer.fit(model, data)
        assert ("train/loss" in trainer.progress_bar_metrics) is bar


def test_the_nan_fault_reaches_the_loss_that_backward_gets(monkeypatch: pytest.MonkeyPatch) -> None:
    """AE_FAULT=nan@train poisons what training_step returns (the loss backward gets), not only
    the logged value: without a non-finite guard the weights turn NaN at that step. (It once
    poisoned only the logged copy, and a run under the fault trained on as if nothing happened.)"""
    import lightning as L
    from torch.utils.data import DataLoader

    from ae.forensics import faults

    monkeypatch.setattr(faults, "_faults", faults.parse_faults("nan@train:step=3"))
    monkeypatch.setattr(faults, "_fired", set())
    model, _ = build(VECTOR)
    trainer = L.Trainer(
        accelerator="cpu", max_steps=5, log_every_n_steps=1, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    trainer.fit(model, DataLoader(torch.rand(64, 24), batch_size=8))
    assert not all(torch.isfinite(p).all() for p in model.parameters())
