"""LR scaling by world size, the warmup + cosine/constant formula, and the optimizer wiring."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from ae.config import ModelConfig, OptimConfig
from ae.data.decode import InputSpec
from ae.training.lr import effective_lr_line, lr_factor, lr_scale_factor, scale_lr, schedule_line
from ae.training.model import AutoEncoder


@pytest.mark.parametrize(
    ("world", "mode", "factor"),
    [(2, "linear", 2.0), (8, "linear", 8.0), (4, "sqrt", 2.0), (2, "sqrt", math.sqrt(2)),
     (8, "none", 1.0), (1, "linear", 1.0)],
)  # fmt: skip
def test_scale_modes(world: int, mode: str, factor: float) -> None:
    assert lr_scale_factor(world, mode) == pytest.approx(factor)
    assert scale_lr(1e-4, world, mode) == pytest.approx(1e-4 * factor)


def test_effective_lr_line_wording() -> None:
    line = effective_lr_line(1e-4, 2, "linear")
    assert line == "Base LR: 0.0001, Effective LR (scaled by 2, linear): 0.0002"


def test_warmup_then_cosine_matches_the_formula() -> None:
    warmup, total = 10, 110
    # warmup: (step + 1) / warmup, reaching 1 at the last warmup step
    assert lr_factor(0, warmup, total, "cosine") == pytest.approx(0.1)
    assert lr_factor(4, warmup, total, "cosine") == pytest.approx(0.5)
    assert lr_factor(9, warmup, total, "cosine") == pytest.approx(1.0)
    # cosine: 0.5 * (1 + cos(pi * (step - warmup) / (total - warmup)))
    assert lr_factor(10, warmup, total, "cosine") == pytest.approx(1.0)
    assert lr_factor(35, warmup, total, "cosine") == pytest.approx(
        0.5 * (1 + math.cos(math.pi / 4))
    )
    assert lr_factor(60, warmup, total, "cosine") == pytest.approx(0.5)  # midpoint
    assert lr_factor(110, warmup, total, "cosine") == pytest.approx(0.0)
    assert lr_factor(500, warmup, total, "cosine") == pytest.approx(0.0)  # stays at the end


def test_constant_and_no_warmup() -> None:
    assert lr_factor(3, 10, 100, "constant") == pytest.approx(0.4)
    assert lr_factor(50, 10, 100, "constant") == 1.0
    assert lr_factor(0, 0, 100, "cosine") == pytest.approx(1.0)
    assert lr_factor(50, 0, 100, "cosine") == pytest.approx(0.5)


def test_schedule_line_warns_when_warmup_eats_the_run() -> None:
    assert "never reaches its peak" in schedule_line(50, 20, "cosine")
    assert "never" not in schedule_line(5, 20, "cosine")


def test_optimizer_groups_and_scheduler_follow_the_formula() -> None:
    """The real configure_optimizers: per-module LR groups, LambdaLR stepped per optimizer step."""
    model = AutoEncoder(
        InputSpec("vector", (16,)),
        ModelConfig(hidden_dim=32, latent_dim=4),
        OptimConfig(learning_rate=2e-4, warmup_steps=4, decoder_lr_mult=0.5, lr_scale="none"),
        world_size=2,
    )
    model._trainer = SimpleNamespace(estimated_stepping_batches=20, is_global_zero=False)
    conf = model.configure_optimizers()
    opt, sched = conf["optimizer"], conf["lr_scheduler"]["scheduler"]
    assert conf["lr_scheduler"]["interval"] == "step"
    assert [g["name"] for g in opt.param_groups] == ["encoder", "decoder"]
    for step in range(20):
        factor = lr_factor(step, 4, 20, "cosine")
        enc, dec = (g["lr"] for g in opt.param_groups)
        assert enc == pytest.approx(2e-4 * factor) and dec == pytest.approx(1e-4 * factor)
        opt.step()
        sched.step()
    assert isinstance(opt, torch.optim.AdamW)
