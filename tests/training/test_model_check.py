"""The model check before training (`ae.training.model_check`): what a user network's loss may
return, loss terms named like ae's own series, and parameters DDP would find without gradient."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from ae.config import ModelConfig, OptimConfig, parse_config
from ae.data.decoding.decode import InputSpec
from ae.training.model import AutoEncoder
from ae.training.model_build import build_model, latent_shape
from ae.training.model_check import (
    forward_not_called,
    naming_unused_parameters,
    unused_parameters,
)
from ae.training.models import ModelError
from tests.support.unused_param_autoencoder import SkipsAParameter

IMAGE = InputSpec("image", (1, 8, 8))
VECTOR = InputSpec("vector", (6,))


class Returns(nn.Module):
    """An identity-ish network whose loss(x) returns `make(loss)`."""

    def __init__(self, make) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 6)
        self.make = make

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x)

    def decode(self, z: torch.Tensor) -> torch.Tensor:
        return z

    def loss(self, x: torch.Tensor):
        return self.make(nn.functional.mse_loss(self.decode(self.encode(x)), x))


def _check(net: nn.Module, spec: InputSpec = VECTOR) -> AutoEncoder:
    model = AutoEncoder(spec, ModelConfig(), OptimConfig(), net=net)
    latent_shape(model, spec, torch.rand(2, *spec.shape))
    return model


def test_a_loss_returning_a_bare_tensor_is_the_loss() -> None:
    """It failed as `TypeError: iteration over a 0-d tensor`; a scalar tensor is the loss."""
    model = _check(Returns(lambda loss: loss))
    x = torch.rand(2, 6)
    loss, terms = model.evaluate(x, model.quality)
    assert terms == {} and loss.dim() == 0
    assert loss.item() == pytest.approx(nn.functional.mse_loss(model(x), x).item())
    both = _check(Returns(lambda loss: (loss, {"recon": loss})))
    assert set(both.evaluate(x, both.quality)[1]) == {"recon"}
    assert _check(Returns(lambda loss: [loss, None])).evaluate(x, both.quality)[1] == {}


@pytest.mark.parametrize(
    ("make", "said"),
    [
        (lambda loss: {"loss": loss}, "returned dict"),
        (lambda loss: (loss, {}, 3), r"returned a tuple of 3: \(Tensor, dict, int\)"),
        (lambda loss: (loss, ["recon"]), r"returned \(loss, list\); the second item must be a"),
        (
            lambda loss: loss.expand(4),
            r"returned a loss of shape \(4,\).*\(e\.g\. its \.mean\(\)\)",
        ),
        (lambda loss: loss.item(), "returned float"),
    ],
)
def test_a_loss_returning_anything_else_is_one_message_saying_what_to_return(make, said) -> None:
    with pytest.raises(ModelError, match=f"^model: loss\\(x\\) {said}") as err:
        _check(Returns(make))
    assert "return a scalar tensor (the loss), or (loss, {name: tensor})" in str(err.value)
    assert err.value.exit_code == 2


@pytest.mark.parametrize(
    ("spec", "names", "taken"),
    [(IMAGE, ("mse", "rate"), "mse"), (IMAGE, ("psnr",), "psnr"), (IMAGE, ("ssim",), "ssim"),
     (VECTOR, ("loss",), "loss"), (VECTOR, ("rel_error", "cosine"), "rel_error, cosine"),
     (VECTOR, ("loss_epoch",), "loss_epoch")],
)  # fmt: skip
def test_loss_terms_named_like_aes_own_series_are_refused_before_training(
    spec: InputSpec, names: tuple[str, ...], taken: str
) -> None:
    """Lightning stopped such a run at its first validation, after a whole epoch ("You called
    self.log(val/mse, ...) twice"): the check on the real batch names them first."""

    class Terms(nn.Module):
        def encode(self, x: torch.Tensor) -> torch.Tensor:
            return x

        def decode(self, z: torch.Tensor) -> torch.Tensor:
            return z

        def loss(self, x: torch.Tensor):
            loss = (x - x).pow(2).mean()
            return loss, dict.fromkeys(names, loss)

    with pytest.raises(ModelError, match=f"^model: loss\\(x\\) returns terms named {taken}, "):
        _check(Terms(), spec)
    _check(Returns(lambda loss: (loss, {"psnr": loss})), VECTOR)  # not a vector metric: free


class ReturnsMuLogvar(nn.Module):
    """The textbook VAE's encode: (mu, logvar)."""

    def __init__(self) -> None:
        super().__init__()
        self.enc, self.dec = nn.Linear(6, 4), nn.Linear(2, 6)

    def encode(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        mu, logvar = self.enc(x).chunk(2, dim=-1)
        return mu, logvar

    def decode(self, z: torch.Tensor) -> torch.Tensor:
        return self.dec(z)


def test_an_encode_returning_mu_and_logvar_is_told_where_the_vae_goes() -> None:
    """ "return its [0]" alone would have the user train the VAE as a plain autoencoder."""
    with pytest.raises(ModelError) as err:
        _check(ReturnsMuLogvar())
    assert str(err.value) == (
        "model: encode returned tuple; return its [0] (the latent ae-encode writes and the grids "
        "decode: for a VAE its mean; sample and add the KL term in loss(x), see 'Your own model' "
        "in docs/TRAINING.md)"
    )


class ForwardsAVAE(ReturnsMuLogvar):
    """encode gives the mean, as ae asks; the sampling and the KL term live in forward alone."""

    def encode(self, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return super().encode(x)[0]

    def forward(self, x: torch.Tensor):
        mu, logvar = super().encode(x)
        z = mu + torch.randn_like(mu) * (0.5 * logvar).exp()
        return self.decode(z), mu, logvar


def test_a_forward_that_ae_never_calls_is_said_when_it_holds_more_than_a_reconstruction() -> None:
    """It trained as a plain autoencoder without a word: ae calls encode/decode, not forward."""
    x = torch.rand(2, 6)
    assert forward_not_called(_check(ForwardsAVAE()), x) == (
        "Model: its forward(x) returns a tuple of 3, but ae does not call forward: it trains "
        "decode(encode(x)) with --loss; a loss of its own (a VAE's sampling and KL term) goes in "
        "loss(x) (see 'Your own model' in docs/TRAINING.md)"
    )

    class WithLoss(ForwardsAVAE):
        def loss(self, x: torch.Tensor) -> torch.Tensor:
            return self(x)[0].pow(2).mean()

    class PlainForward(ForwardsAVAE):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.decode(self.encode(x))

    for quiet in (WithLoss(), PlainForward(), Returns(lambda loss: loss)):
        assert forward_not_called(_check(quiet), x) is None
    assert forward_not_called(AutoEncoder(VECTOR, ModelConfig(), OptimConfig()), x) is None


def _skips(world_size: int, **optim: object):
    spec = InputSpec("vector", (6,))
    cfg = ModelConfig(model="tests.support.unused_param_autoencoder:SkipsAParameter")
    return build_model(spec, cfg, OptimConfig(**optim), world_size, batch=torch.rand(2, 6))


def test_parameters_without_gradient_are_named_with_the_flag_for_several_processes() -> None:
    """DDP failed at step 1 with "parameters that were not used", naming a setting no flag
    reached: the check names the parameter and --find_unused_parameters before training."""
    with pytest.raises(ModelError) as err:
        _skips(world_size=2)
    assert str(err.value) == (
        "model: 1 of its 5 trainable parameters get no gradient from the loss on a real batch "
        "(net.quantiles); with several processes, DDP fails at the first step unless it looks "
        "for them: pass --find_unused_parameters (slower per step), or use them in the loss"
    )
    model, _ = _skips(world_size=2, find_unused_parameters=True)  # the flag: DDP finds them
    assert all(p.grad is None for p in model.parameters())  # the check wrote no gradient
    assert model.training
    _skips(world_size=1)  # one process: no DDP, nothing to find
    assert parse_config(["--find_unused_parameters"]).optim.find_unused_parameters


class _UsesA(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(2, 2), nn.Linear(2, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.a(x)


def test_ddps_unused_parameter_error_in_training_is_named_with_the_flag(tmp_path) -> None:
    """A LightningModule of the user's (its own training_step: the check before training cannot
    run it) failed at step 2 with Lightning's "set `strategy='ddp_find_unused_parameters_true'`",
    a setting no flag of ae reaches: one ModelError names the parameters and the flag."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    dist.init_process_group(
        "gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1
    )
    try:
        ddp = DistributedDataParallel(_UsesA())
        with pytest.raises(ModelError) as err, naming_unused_parameters(ddp.module):
            for _ in range(2):  # DDP says so at the step after the one that left them out
                ddp(torch.rand(3, 2)).sum().backward()
    finally:
        dist.destroy_process_group()
    assert str(err.value).startswith(
        "model: 2 of its 4 trainable parameters get no gradient from the loss of its training "
        "step (b.weight, b.bias); with several processes, DDP fails at the first step unless it "
        "looks for them: pass --find_unused_parameters"
    )
    lightnings = RuntimeError(
        "It looks like your LightningModule has parameters that were not used in producing the "
        "loss returned by training_step. ..."
    )
    with (
        pytest.raises(ModelError, match="--find_unused_parameters"),
        naming_unused_parameters(_UsesA()),
    ):
        raise lightnings
    # anything else goes on as it was
    with pytest.raises(RuntimeError, match=r"^other$"), naming_unused_parameters(_UsesA()):
        raise RuntimeError("other")


def test_the_check_moves_no_running_statistic() -> None:
    class Normed(SkipsAParameter):
        def __init__(self, input_shape: tuple[int, ...]) -> None:
            super().__init__(input_shape)
            self.norm = nn.BatchNorm1d(6)

        def decode(self, z: torch.Tensor) -> torch.Tensor:
            return self.norm(super().decode(z))

    model = AutoEncoder(VECTOR, ModelConfig(), OptimConfig(), net=Normed((6,)))
    before = model.net.norm.running_mean.clone()
    unused = unused_parameters(
        model, lambda x: model.evaluate(x, model.quality)[0], torch.rand(4, 6)
    )
    assert unused == ["net.quantiles"] and torch.equal(model.net.norm.running_mean, before)
