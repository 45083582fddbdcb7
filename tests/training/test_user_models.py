"""A user's own class behind --model=package.module:ClassName: located without running it, an
nn.Module wrapped (with the input shape and --model_args), a LightningModule used as it is,
and every class that cannot be used one model error; the documented example class."""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from ae.config import ConfigError, ModelConfig, OptimConfig, parse_config
from ae.config.model_path import locate_class
from ae.training.model import AutoEncoder
from ae.training.model_build import build_model
from ae.training.models import ModelError
from tests.training.model_building import IMAGE, VECTOR, build

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

class RaisesInEncode(Flat):
    def encode(self, x):
        raise RuntimeError("in my code")

class ForwardOnly(nn.Module):
    def __init__(self, input_shape):
        super().__init__()
        self.net = nn.Linear(input_shape[0], input_shape[0])
    def forward(self, x):
        return self.net(x)

class NoDecode(nn.Module):
    def encode(self, x):
        return x

class Lit(L.LightningModule):
    def __init__(self, width=2):
        super().__init__()
        self.width = width

class LitManual(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.automatic_optimization = False

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
    (tmp_path / "brokenmods.py").write_text("import torch\nimport not_installed_xyz\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))
    for name in ("flatmods", "brokenmods", "mypkg", "mypkg.models"):
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
        (  # the usual first try: forward(x) -> x_hat alone
            "flatmods:ForwardOnly",
            None,
            r"it is a ForwardOnly without encode and decode; split its forward into encode\(x\) "
            r"-> z and decode\(z\) -> x_hat \(see 'Your own model' in docs/TRAINING.md\)$",
        ),
        (  # the arguments its constructor needs, as the flag that gives them
            "flatmods:NeedsArgs",
            {"depth": 2},
            r"missing 1 required positional argument: 'width'; give them with "
            r"--model_args='\{depth: 2, width: \.\.\.\}'$",
        ),
        ("flatmods:WrongShape", None, r"decode\(encode\(x\)\) gives \(2, 3\) for x of \(2, 24\)"),
        # a failure in the user's own code names its line (the traceback: the rank's debug log)
        (
            "flatmods:RaisesInEncode",
            None,
            r"fails on a batch of shape \(2, 24\): RuntimeError: in my code \(at flatmods.py:\d+, "
            r"in encode\)$",
        ),
        (
            "brokenmods:Net",
            None,
            r"cannot import brokenmods: ModuleNotFoundError: No module named 'not_installed_xyz' "
            r"\(at brokenmods.py:2\)$",
        ),
    ],
)
def test_user_class_that_cannot_be_used_is_one_model_error(
    user_module: str, path: str, args: dict | None, message: str
) -> None:
    with pytest.raises(ModelError, match=message):
        build(VECTOR, model=path, model_args=args)


def test_flags_lightning_cannot_apply_to_manual_optimization_are_named(user_module: str) -> None:
    """A LightningModule that steps its optimizers itself (a GAN's): Lightning refused the run
    at its start for --gradient_clip_val's default, naming `Trainer(gradient_clip_val=1.0)`, a
    setting no flag of ae reaches (found by the own-model walkthrough). At its default the flag
    is turned off for it (`build_trainer`); set, it is refused with the accumulation."""
    model, _ = build(VECTOR, model="flatmods:LitManual")  # the default clip: fine
    assert not model.automatic_optimization
    with pytest.raises(ModelError) as err:
        optim = OptimConfig(gradient_clip_val=0.5, gradient_accumulation_steps=2)
        build_model(VECTOR, ModelConfig(model="flatmods:LitManual"), optim, 1)
    assert str(err.value).splitlines() == [
        "gradient_clip_val: 0.5: a LightningModule that optimizes manually "
        "(automatic_optimization = False) clips its own gradients (self.clip_gradients in its "
        "training_step); leave the flag at its default",
        "gradient_accumulation_steps: 2: a LightningModule that optimizes manually "
        "(automatic_optimization = False) steps its optimizers itself: accumulate in its "
        "training_step, and leave the flag at 1",
    ]


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
