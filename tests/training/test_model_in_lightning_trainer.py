"""The model in a real Lightning Trainer on the CPU: no step value becomes a Python number
(a host sync) without a progress bar, and the injected NaN fault reaches the loss that
backward gets."""

from __future__ import annotations

import pytest
import torch

from tests.training.model_building import VECTOR, build


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
