"""The optimizer's parameter groups: the generator's by module (`--encoder_lr_mult`,
`--decoder_lr_mult`), and the discriminator's of the latent-diffusion recipe, with its own betas,
no weight decay, and its own gradient clipping."""

from __future__ import annotations

import torch
from torch import nn

from ae.training.models import ModelError


class MeasuredNorm:
    """The total gradient norm of the optimizer step under way, measured by the non-finite guard
    (`ae.training.nonfinite`, which measures it first) and used by the model's clipping rather
    than measured again, a pass over every gradient a step. A plain box: a tensor attribute of
    the module would be stored through nn.Module's __setattr__ (~1.5 us), twice a step."""

    __slots__ = ("value",)

    def __init__(self) -> None:
        self.value: torch.Tensor | None = None


def generator_groups(
    params: list[nn.Parameter], owner: nn.Module, mults: tuple[float, float]
) -> list[tuple[str, list[nn.Parameter], float]]:
    """(name, parameters, LR multiplier): `encoder` and `decoder` when `owner` has both
    submodules, and `other` for the rest of `params`; else one `model` group."""
    halves = [getattr(owner, n, None) for n in ("encoder", "decoder")]
    if not all(isinstance(m, nn.Module) for m in halves):
        if mults != (1.0, 1.0):
            raise ModelError(
                "encoder_lr_mult/decoder_lr_mult: the model has no `encoder` and `decoder` "
                "submodules to apply them to"
            )
        return [("model", params, 1.0)]
    groups = [
        (name, list(m.parameters()), mult)
        for name, m, mult in zip(("encoder", "decoder"), halves, mults, strict=True)
    ]
    taken = {id(p) for _, group, _ in groups for p in group}
    rest = [p for p in params if id(p) not in taken]
    return groups + ([("other", rest, 1.0)] if rest else [])


def param_groups(
    generator: list[dict], discriminator: nn.Module | None, disc_lr: float
) -> list[dict]:
    """The optimizer's groups: the generator's, then the discriminator's, with taming's Adam
    betas (0.5, 0.9) and no weight decay."""
    if discriminator is None:
        return generator
    d_group = {
        "params": list(discriminator.parameters()), "lr": disc_lr, "betas": (0.5, 0.9),
        "weight_decay": 0.0, "name": "discriminator",
    }  # fmt: skip
    return [*generator, d_group]


def clip_groups(optimizer: torch.optim.Optimizer, max_norm: float) -> None:
    """`--gradient_clip_val` over the generator's groups, and over the discriminator's on its
    own: a run is clipped before `--disc_start` exactly as without a discriminator."""
    gen, disc = [], []
    for group in optimizer.param_groups:
        (disc if group.get("name") == "discriminator" else gen).extend(group["params"])
    for params in (gen, disc):
        if params:
            torch.nn.utils.clip_grad_norm_(params, max_norm)
