"""The module a run trains, from its flags: an `AutoEncoder` around a built-in or user network, or
the user's own LightningModule, checked on a real batch before any dataloader worker starts
(`latent_shape`; the rules are `ae.training.model_check`'s)."""

from __future__ import annotations

import lightning as L
import torch
from torch import nn

from ae.config import BUILTIN_MODELS, FIELDS, ModelConfig, ObjectiveConfig, OptimConfig
from ae.data.decoding.decode import InputSpec
from ae.training.model import AutoEncoder
from ae.training.model_check import (
    first_line,
    not_a_tensor,
    term_names_problem,
    unused_parameters,
    unused_problem,
)
from ae.training.models import ModelError, user
from ae.training.quality import QualityMetrics

DEFAULT_CLIP = FIELDS["gradient_clip_val"].default


def has_codec(module: nn.Module) -> bool:
    """Whether the module has encode(x) and decode(z) (every AutoEncoder does)."""
    return all(callable(getattr(module, m, None)) for m in ("encode", "decode"))


def latent_shape(
    module: nn.Module, spec: InputSpec, batch: torch.Tensor | None = None
) -> tuple[int, ...] | None:
    """The shape of one sample's latent, from `encode` on `batch` (real samples; without it a
    dummy batch of 2), or None when the module has no encode/decode. Every mistake is one
    ModelError: `encode` or `decode` returning no tensor, a `decode(encode(x))` of the wrong
    shape, and (with a real batch) anything that would fail in validation: an AutoEncoder
    computes its loss and validation metrics on the batch, as validation will."""
    if not has_codec(module):
        return None
    x = torch.zeros(2, *spec.shape) if batch is None else batch
    was_training = module.training
    module.eval()
    try:
        with torch.no_grad():
            try:
                z = module.encode(x)
                out = module.decode(z) if torch.is_tensor(z) else None
            except Exception as e:  # a user network may fail in any way on our batch
                raise ModelError(
                    f"model: decode(encode(x)) fails on a batch of shape {tuple(x.shape)}: "
                    f"{first_line(e)}"
                ) from e
            if not torch.is_tensor(z):
                raise ModelError(not_a_tensor("encode", z))
            if not torch.is_tensor(out):
                raise ModelError(not_a_tensor("decode", out))
            if out.shape != x.shape:
                got = tuple(out.shape)
                raise ModelError(f"model: decode(encode(x)) gives {got} for x of {tuple(x.shape)}")
            if batch is not None and isinstance(module, AutoEncoder):
                try:
                    _, terms = module.evaluate(x, QualityMetrics(spec).to(x.device))
                except ModelError:  # what its loss() returned: said already
                    raise
                except Exception as e:
                    raise ModelError(
                        f"model: its loss or validation metrics fail on a batch of "
                        f"{tuple(x.shape)}: {first_line(e)}"
                    ) from e
                if problem := term_names_problem(list(terms), spec.kind):
                    raise ModelError(problem)
    finally:
        module.train(was_training)
    return tuple(z.shape[1:])


def manual_optimization_problems(optim: OptimConfig) -> list[str]:
    """The flags Lightning cannot apply to a LightningModule that optimizes manually
    (`automatic_optimization = False`, as GANs do): it refused the run at its start, naming
    `Trainer(...)` arguments ae's users do not have. --gradient_clip_val at its default is
    turned off for it instead (`build_trainer`): its own training_step clips, if it does."""
    problems = []
    if optim.gradient_clip_val not in (0, DEFAULT_CLIP):
        problems.append(
            f"gradient_clip_val: {optim.gradient_clip_val}: a LightningModule that optimizes "
            "manually (automatic_optimization = False) clips its own gradients "
            "(self.clip_gradients in its training_step); leave the flag at its default"
        )
    if optim.gradient_accumulation_steps > 1:
        problems.append(
            f"gradient_accumulation_steps: {optim.gradient_accumulation_steps}: a "
            "LightningModule that optimizes manually (automatic_optimization = False) steps its "
            "optimizers itself: accumulate in its training_step, and leave the flag at 1"
        )
    return problems


def build_model(
    spec: InputSpec,
    model: ModelConfig,
    optim: OptimConfig,
    world_size: int,
    batch: torch.Tensor | None = None,
    objective: ObjectiveConfig | None = None,
) -> tuple[L.LightningModule, tuple[int, ...] | None]:
    """The module to train: an AutoEncoder around a built-in or user network, or the user's own
    LightningModule; and the shape of one sample's latent (None without encode/decode). Every
    problem is a ModelError naming the flag; `batch` (real samples) is checked as validation
    will compute on it (`latent_shape`)."""
    if model.model in BUILTIN_MODELS:
        module: L.LightningModule = AutoEncoder(spec, model, optim, world_size, objective=objective)
    else:
        obj = user.build(user.load_class(model.model), model.model_args, spec.shape)
        if isinstance(obj, L.LightningModule):
            if model.compile:
                raise ModelError("compile: a LightningModule of your own compiles itself")
            if objective is not None and (objective.perceptual_weight or objective.disc_weight):
                raise ModelError(
                    "perceptual_weight/disc_weight: a LightningModule of your own trains as it "
                    "is; the recipe's terms are for an nn.Module with encode/decode"
                )
            if not obj.automatic_optimization:  # it steps its optimizers itself
                problems = manual_optimization_problems(optim)
                if problems:
                    raise ModelError("\n".join(problems))
            if objective is not None and objective.fid_weights:
                raise ModelError(
                    "fid_weights: a LightningModule of your own validates as it is; rFID is "
                    "for an nn.Module with encode/decode"
                )
            module = obj
        else:
            module = AutoEncoder(spec, model, optim, world_size, net=obj, objective=objective)
    latent = latent_shape(module, spec, batch)  # checked before any worker starts
    ddp = world_size > 1 and not optim.find_unused_parameters
    if ddp and batch is not None and isinstance(module, AutoEncoder):  # our loss: known here
        # The discriminator is not in the generator's loss: the recipe keeps its parameters in
        # every step's graph itself (a zero-valued term before --disc_start).
        unused = [
            name
            for name in unused_parameters(module, lambda x: module._step(x)[0], batch)
            if not name.startswith("discriminator.")
        ]
        if unused:
            total = sum(p.requires_grad for p in module.parameters())
            raise ModelError(unused_problem(unused, total))
    return module, latent
