"""The rules of the model check before training (`ae.training.model_build.latent_shape` and
`build_model` run it on a real batch): what a user model's methods return, the names of its loss
terms, and parameters that get no gradient. Each mistake is one `ModelError` naming the fix,
before any dataloader worker starts, not a traceback mid-step or at the first validation."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from ae.training.models import ModelError
from ae.training.models.user import first_line
from ae.training.quality import METRIC_NAMES

# What `ae` itself logs as `train/<name>` and `val/<name>` (besides the quality metrics): a loss
# term of the same name would be logged twice in one step, which Lightning refuses.
OWN_SERIES = ("loss", "loss_epoch")
LOSS_RETURNS = "return a scalar tensor (the loss), or (loss, {name: tensor}) to log terms too"


def not_logged(head: str, wanted: str, logged: list[str], calls: str) -> str:
    """The warning for a model (a LightningModule of the user's: Lightning's habit is
    `val_loss`) that logged none of the `wanted` names a feature reads: `head`, what it logged,
    and the `calls` that log them."""
    named = ", ".join(sorted(logged)) or "nothing"
    return (
        f"{head}: the model logged no {wanted} (it logged {named}); a LightningModule of your "
        f"own logs {calls}"
    )


def not_a_tensor(method: str, value: object) -> str:
    """`decode returned DecoderOutput; return its .sample`: what a model returned instead of a
    tensor, and where the tensor in it is (a dataclass field, a mapping key, a tuple item)."""
    where = None
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        fields = [f.name for f in dataclasses.fields(value)]
        where = next((f".{n}" for n in fields if torch.is_tensor(getattr(value, n))), None)
    elif isinstance(value, Mapping):
        where = next((f"[{k!r}]" for k, v in value.items() if torch.is_tensor(v)), None)
    elif isinstance(value, tuple | list):
        where = next((f"[{i}]" for i, v in enumerate(value) if torch.is_tensor(v)), None)
    fix = f"return its {where}" if where else "return a torch.Tensor"
    tensors = [v for v in value if torch.is_tensor(v)] if isinstance(value, tuple | list) else []
    if method == "encode" and len(tensors) >= 2:
        # A VAE's (mu, logvar): returning [0] alone would silently train it as a plain
        # autoencoder; where the sampling and the KL term go is the rest of the fix.
        fix += (
            " (the latent ae-encode writes and the grids decode: for a VAE its mean; sample "
            "and add the KL term in loss(x), see 'Your own model' in docs/TRAINING.md)"
        )
    return f"model: {method} returned {type(value).__name__}; {fix}"


def user_loss(value: Any) -> tuple[torch.Tensor, dict[str, Any]]:
    """What a user network's `loss(x)` returned, as (loss, {name: term}): a scalar tensor alone
    is the loss; (loss, terms) with terms a mapping or None. Anything else is a ModelError that
    says what to return (a bare tensor once failed as `iteration over a 0-d tensor`)."""
    if torch.is_tensor(value):
        loss, terms = value, None
    elif isinstance(value, tuple | list) and len(value) == 2 and torch.is_tensor(value[0]):
        loss, terms = value
        if terms is not None and not isinstance(terms, Mapping):
            raise ModelError(
                f"model: loss(x) returned (loss, {type(terms).__name__}); the second item must "
                f"be a mapping of names to tensors, or None: {LOSS_RETURNS}"
            )
    else:
        shown = type(value).__name__
        if isinstance(value, tuple | list):
            shown = f"a {shown} of {len(value)}: ({', '.join(type(v).__name__ for v in value)})"
        raise ModelError(f"model: loss(x) returned {shown}; {LOSS_RETURNS}")
    if loss.dim() != 0:
        raise ModelError(
            f"model: loss(x) returned a loss of shape {tuple(loss.shape)}; {LOSS_RETURNS} (e.g. "
            "its .mean())"
        )
    return loss, dict(terms or {})


def term_names_problem(names: list[str], kind: str) -> str | None:
    """The problem of loss terms named like a series `ae` logs itself (`mse`, `psnr`, `loss`):
    Lightning would stop the run at the first validation ("You called self.log(val/mse) twice");
    None when every name is free."""
    own = (*OWN_SERIES, *METRIC_NAMES[kind])
    taken = [n for n in names if n in own]
    if not taken:
        return None
    return (
        f"model: loss(x) returns terms named {', '.join(taken)}, which ae logs itself "
        f"(train/<name> and val/<name>: {', '.join(own)}); rename them (e.g. "
        f"{taken[0]} -> my_{taken[0]})"
    )


def unused_parameters(
    module: nn.Module, loss_of: Callable[[torch.Tensor], torch.Tensor], batch: torch.Tensor
) -> list[str]:
    """The trainable parameters that get no gradient from `loss_of(batch)` (in eval mode: no
    running statistic moves; no `.grad` is written). DDP needs every parameter in every step
    unless told otherwise (--find_unused_parameters)."""
    params = [(name, p) for name, p in module.named_parameters() if p.requires_grad]
    was_training = module.training
    module.eval()
    try:
        with torch.enable_grad():
            loss = loss_of(batch)
            if not loss.requires_grad:
                return [name for name, _ in params]
            grads = torch.autograd.grad(loss, [p for _, p in params], allow_unused=True)
    except Exception as e:  # a user network may fail in any way on our batch
        raise ModelError(
            f"model: the gradient of its loss fails on a batch of {tuple(batch.shape)}: "
            f"{first_line(e)}"
        ) from e
    finally:
        module.train(was_training)
    return [name for (name, _), grad in zip(params, grads, strict=True) if grad is None]


def unused_problem(unused: list[str], total: int, where: str = "the loss on a real batch") -> str:
    shown = ", ".join(unused[:5]) + (f", ... ({len(unused)} in all)" if len(unused) > 5 else "")
    return (
        f"model: {len(unused)} of its {total} trainable parameters get no gradient from "
        f"{where} ({shown}); with several processes, DDP fails at the first step "
        "unless it looks for them: pass --find_unused_parameters (slower per step), or use "
        "them in the loss"
    )


# DDP's error at the step after one that left a parameter without gradient, and Lightning's
# rewording of it (which names `strategy=...`, a setting ae's users do not have).
_DDP_UNUSED = (
    "Expected to have finished reduction in the prior iteration",
    "parameters that were not used in producing the loss",
)


@contextmanager
def naming_unused_parameters(module: nn.Module) -> Iterator[None]:
    """Training under DDP: its unused-parameter error becomes one `ModelError` naming the
    parameters and --find_unused_parameters. The check before training cannot see them in a
    LightningModule of the user's (its own training_step) or in a loss that leaves some out only
    in training mode; DDP's own message names `find_unused_parameters=True` or Lightning's
    `strategy=`, neither of them a flag of ae."""
    try:
        yield
    except RuntimeError as e:
        if not any(s in str(e) for s in _DDP_UNUSED):
            raise
        params = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        # Grads are not zeroed (set to None) before the next backward: those still None got none
        unused = [n for n, p in params if p.grad is None]
        if unused:
            problem = unused_problem(unused, len(params), "the loss of its training step")
        else:
            problem = (
                "model: some of its trainable parameters got no gradient in a training step; "
                "with several processes, DDP needs --find_unused_parameters (slower per step) "
                "unless every parameter is in the loss of every step"
            )
        raise ModelError(problem) from e


def forward_not_called(module: nn.Module, batch: torch.Tensor) -> str | None:
    """The warning for a user network whose own forward(x) returns more than a tensor (a VAE's
    `(recon, mu, logvar)`) and that has no loss(x): ae never calls forward, so its sampling and
    KL term would not be trained, without a word. None otherwise (a forward that is
    decode(encode(x)), or one that fails here: not ae's to judge)."""
    net = getattr(module, "net", None)  # the user's network inside ae's AutoEncoder
    if not isinstance(net, nn.Module) or callable(getattr(net, "loss", None)):
        return None
    if type(net).forward is nn.Module.forward:
        return None
    was_training = net.training
    net.eval()
    try:
        with torch.no_grad():
            out = net(batch)
    except Exception:  # a user network may fail in any way on our batch
        return None
    finally:
        net.train(was_training)
    if torch.is_tensor(out):
        return None
    shown = type(out).__name__
    if isinstance(out, tuple | list):
        shown = f"a {shown} of {len(out)}"
    return (
        f"Model: its forward(x) returns {shown}, but ae does not call forward: it trains "
        "decode(encode(x)) with --loss; a loss of its own (a VAE's sampling and KL term) goes "
        "in loss(x) (see 'Your own model' in docs/TRAINING.md)"
    )
