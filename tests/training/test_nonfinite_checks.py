"""The non-finite guard's parts, without a fit: a dropped step leaves the epoch's mean loss;
the save guard's check finds the first non-finite tensor (on two devices too, under CUDA);
the sample description names non-finite inputs alone; the loss curve draws the marks."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ae.data.stream.batch_members import Member, describe_members
from ae.training.nonfinite import nonfinite_in


def test_a_dropped_step_takes_all_its_batches_out_of_the_mean() -> None:
    """Under gradient accumulation a step is several batches: a dropped step takes them all,
    the finite ones too; an epoch of dropped steps alone has no mean."""
    from ae.training.epoch_loss import EpochLoss

    mean = EpochLoss()
    for step, losses in enumerate([(1.0, 3.0), (5.0, float("nan")), (2.0, 6.0)]):
        for loss in losses:
            mean.add(torch.tensor(loss), step)
        if step == 1:  # what the guard does before that step's optimizer step
            mean.drop_step()
    share = mean.share(torch.device("cpu"))
    assert share is not None and (float(share[0]), share[1]) == (3.0, 4)
    mean.start()
    mean.add(torch.tensor(float("nan")), 7)
    mean.drop_step()
    assert mean.share(torch.device("cpu")) is None


def test_the_state_check_names_the_first_non_finite_tensor() -> None:
    ok, bad = torch.ones(3), torch.tensor([1.0, float("inf")])
    assert nonfinite_in([("a", ok), ("steps", torch.tensor(3)), ("b", bad), ("c", bad)]) == "b"
    assert nonfinite_in([("a", ok)]) is None


def test_samples_with_non_finite_input_are_named_alone() -> None:
    members = [Member("a.tar", "k1", True), Member("a.tar", "k2", False),
               Member("b.tar", "k3", True)]  # fmt: skip
    assert describe_members(members) == "shard a.tar, keys [k2] (non-finite input)"
    fine = [m for m in members if m.finite]
    assert describe_members(fine) == "shard a.tar, keys [k1]; shard b.tar, keys [k3]"


def test_the_loss_curve_draws_the_marks(tmp_path: Path) -> None:
    from ae.training.plots import loss_plot

    series = {"train/loss": [(float(s), 1.0 / s) for s in range(1, 50)]}
    loss_plot(series, tmp_path / "plain.png")
    loss_plot(series, tmp_path / "marked.png", marks=[(20, "loss spike"), (30, "non-finite")])
    assert (tmp_path / "plain.png").read_bytes() != (tmp_path / "marked.png").read_bytes()


@pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA: weights there, Adam's step on the CPU"
)
def test_the_save_guard_reads_a_state_on_two_devices() -> None:
    """The state of a GPU run mixes devices (Adam's `step` stays on the CPU): found on an H200,
    where the save guard's single stack failed the first checkpoint save."""
    bad = torch.tensor([1.0, float("nan")], device="cuda")
    named = [("step", torch.tensor(3.0)), ("w", torch.ones(2, device="cuda")), ("b", bad)]
    assert nonfinite_in(named) == "b"
