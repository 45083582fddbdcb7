"""LR scaling by world size, the warmup + cosine/constant formula, and the optimizer wiring."""

from __future__ import annotations

import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from ae.config import CheckpointConfig, ModelConfig, OptimConfig
from ae.data.decoding.decode import InputSpec
from ae.log_lines import LR_FROM_FLAGS, LR_RESCALED
from ae.run_paths import RunDir
from ae.training.checkpointing import Checkpointing
from ae.training.lr import (
    Schedule,
    at_schedule_step,
    disc_start_note,
    effective_lr_line,
    lr_factor,
    lr_rescaled_line,
    lr_scale_factor,
    rescale,
    scale_lr,
    schedule_line,
    steps_to_end,
)
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


def test_a_discriminator_starting_after_the_run_is_said() -> None:
    """The default --disc_start (50,001) in a 300-step run: the discriminator never trains."""
    note = disc_start_note(50_001, 300)
    assert note is not None and "--disc_start=50001 is after this run's last step (300)" in note
    assert disc_start_note(300, 300) is None and disc_start_note(0, 300) is None


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


def test_steps_to_end_follows_lightnings_accumulation() -> None:
    # the rest of a resumed epoch (batches 3..16 of 17), then one whole epoch of 15
    common = {"done": 3, "epoch_len": 17, "full_len": 15, "epoch": 0, "max_epochs": 2}
    assert steps_to_end(**common, accumulation=1) == 14 + 15
    # steps end at batches 4, 8, 12, 16 and the epoch's last (17); then 4, 8, 12 and 15
    assert steps_to_end(**common, accumulation=4) == 5 + 4
    assert steps_to_end(**{**common, "epoch": 1}, accumulation=1) == 14  # the last epoch


def test_schedule_is_saved_with_the_scheduler_and_replanned_to_its_end() -> None:
    params = [torch.nn.Parameter(torch.zeros(1))]
    opt = torch.optim.SGD(params, lr=1.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, Schedule(2, 10, "cosine"))
    for _ in range(6):
        opt.step()
        sched.step()
    state = sched.state_dict()
    # a resumed run builds its schedule for its own estimate; the checkpoint's length comes back
    opt2 = torch.optim.SGD(params, lr=1.0)
    sched2 = torch.optim.lr_scheduler.LambdaLR(opt2, Schedule(2, 99, "cosine"))
    sched2.load_state_dict(state)
    schedule = sched2.lr_lambdas[0]
    assert schedule.total_steps == 10 and sched2.last_epoch == 6
    schedule.total_steps = 20  # re-planned: 14 more steps
    before = Schedule(2, 10, "cosine")(6)
    assert opt2.param_groups[0]["lr"] == pytest.approx(before)  # the checkpoint's plan's
    at_schedule_step(opt2, sched2)  # the next step takes the new plan's LR
    assert opt2.param_groups[0]["lr"] == pytest.approx(schedule(6)) and schedule(6) > before
    for _ in range(14):
        opt2.step()
        sched2.step()
    assert sched2.get_last_lr()[0] == pytest.approx(0.0)  # the cosine's end at the last step
    assert schedule(19) > 0


def test_a_resume_on_fewer_ranks_rescales_the_lr_the_checkpoint_carries() -> None:
    """A checkpoint of 2 ranks (sqrt: LR x 1.414) resumed on 1: loading its state brings back
    the 2-rank LR, which `rescale` sets to the 1-rank one at the schedule's step."""
    params = [torch.nn.Parameter(torch.zeros(1))]
    two = scale_lr(1e-3, 2, "sqrt")
    opt = torch.optim.AdamW(params, lr=two)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, Schedule(2, 10, "cosine"))
    for _ in range(4):
        opt.step()
        sched.step()
    saved = opt.state_dict(), sched.state_dict()
    one = scale_lr(1e-3, 1, "sqrt")
    opt2 = torch.optim.AdamW(params, lr=one)
    sched2 = torch.optim.lr_scheduler.LambdaLR(opt2, Schedule(2, 10, "cosine"))
    opt2.load_state_dict(saved[0])
    sched2.load_state_dict(saved[1])
    assert sched2.base_lrs == [pytest.approx(two)]  # what a resume alone would train with
    assert rescale(opt2, sched2, [one]) == (pytest.approx(two), one)
    assert opt2.param_groups[0]["lr"] == pytest.approx(one * lr_factor(4, 2, 10, "cosine"))
    opt2.step()
    sched2.step()
    assert sched2.get_last_lr()[0] == pytest.approx(one * lr_factor(5, 2, 10, "cosine"))
    assert rescale(opt2, sched2, [one]) is None  # this run's LR already: nothing to say
    line = LR_RESCALED.parse(lr_rescaled_line(1, 4, two, one, "sqrt"))
    assert line is not None and (line["world"], line["old"], line["new"]) == (
        "1",
        "0.00141421",
        "0.001",
    )


def test_a_resume_with_another_lr_flag_says_that_flag_not_the_ranks(tmp_path: Path) -> None:
    """Was, resumed on the same 2 ranks with another --learning_rate: `LR re-scaled for 2 ranks
    at step 3` and `re-scaled the LR for 2 ranks`, as if the ranks had changed."""
    line = lr_rescaled_line(2, 3, 0.00141421, 0.0141421, "sqrt", ["learning_rate"])
    assert line == (
        "LR set from the new --learning_rate at step 3: effective LR 0.00141421 -> 0.0141421 "
        "(scaled by 1.41421 for 2 ranks, sqrt); the schedule goes on from there"
    )
    assert LR_FROM_FLAGS.parse(line) is not None and LR_RESCALED.parse(line) is None
    settings = {"learning_rate": 0.01, "lr_scale": "sqrt", "devices": "2", "max_steps": 6}
    callback = Checkpointing(CheckpointConfig(), RunDir(tmp_path), settings, "")
    saved = {**settings, "learning_rate": 0.001, "max_steps": 3}
    callback.on_load_checkpoint(None, None, {"global_step": 3, "epoch": 0, "ae_config": saved})  # type: ignore[arg-type]
    assert callback._lr_flags == ["learning_rate"]
    saved = {**settings, "devices": "1"}  # another world size alone: re-scaled for the ranks
    callback.on_load_checkpoint(None, None, {"global_step": 3, "epoch": 0, "ae_config": saved})  # type: ignore[arg-type]
    assert callback._lr_flags == []
