"""The model in a real Lightning Trainer on the CPU: no step value becomes a Python number
(a host sync) without a progress bar, the injected NaN fault reaches the loss that backward
gets, and validation counts each sample once."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pytest
import torch

from ae.config import DataConfig
from ae.data.datamodule import ShardDataModule
from ae.data.shards.writer import write_shard
from tests.support.shards import vector_samples
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


@pytest.mark.parametrize("workers", [0, 2])
def test_validation_counts_each_sample_once_where_pad_mode_repeats_some(
    tmp_path: Path, workers: int
) -> None:
    """5 validation samples in batches of 4 (`--shard_split=pad`): the second batch holds one
    of them and 3 repeats, which the loss and the metrics leave out (they weighed 4 of the 5
    samples twice as much as the fifth before)."""
    import lightning as L

    samples = vector_samples(5, dim=24, start=100)
    write_shard(tmp_path / "train.tar", vector_samples(16, dim=24))
    write_shard(tmp_path / "val.tar", samples)
    cfg = DataConfig(batch_size=4, num_workers=workers, shard_split="pad", count_cache="off")
    dm = ShardDataModule(cfg, [str(tmp_path / "train.tar")], [str(tmp_path / "val.tar")], seed=0)
    model, _ = build(VECTOR)
    trainer = L.Trainer(
        accelerator="cpu", logger=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    (metrics,) = trainer.validate(model, datamodule=dm, verbose=False)
    x = torch.from_numpy(np.stack([np.load(io.BytesIO(s["npy"])) for s in samples]))
    with torch.no_grad():
        recon = model(x)
    assert metrics["val/mse"] == pytest.approx(torch.mean((recon - x) ** 2).item(), rel=1e-5)
    assert metrics["val/loss"] == pytest.approx(metrics["val/mse"], rel=1e-5)  # --loss=mse
    cosine = torch.nn.functional.cosine_similarity(recon, x, dim=1).mean().item()
    assert metrics["val/cosine"] == pytest.approx(cosine, rel=1e-5)
    assert len(dm.val_set) == 2 and [dm.val_set.repeats_in(b) for b in (0, 1)] == [0, 3]
