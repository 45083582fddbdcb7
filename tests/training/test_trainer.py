"""The trainer refuses a precision its device cannot do, rather than running another."""

from __future__ import annotations

from typing import Any

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader

from ae.config import ConfigError, RunConfig, parse_config
from ae.training.trainer import PER_BATCH_HOOKS, build_trainer, check_precision, skip_idle_hooks
from logging_cfg import RankContext


def test_16_mixed_on_a_cpu_is_refused_not_replaced_by_bf16() -> None:
    with pytest.raises(ConfigError, match=r"precision: 16-mixed needs a GPU.*--precision=32"):
        check_precision(RunConfig(precision="16-mixed"), "cpu")
    check_precision(RunConfig(precision="bf16-mixed"), "cpu")  # what Lightning runs on a CPU


def test_val_shards_none_builds_a_trainer_that_never_validates(tmp_path) -> None:
    """Validation off: Lightning's own switch at 0, so no val loss and no best.ckpt."""
    base = [f"--output_dir={tmp_path}", "--accelerator=cpu"]
    off = build_trainer(parse_config([*base, "--val_shards=none"]), RankContext(), "TS", {})
    assert off.limit_val_batches == 0
    assert build_trainer(parse_config(base), RankContext(), "TS", {}).limit_val_batches == 1.0


class _Counts(L.Callback):
    def __init__(self) -> None:
        self.ends = 0

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        self.ends += 1


class _Tiny(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(2, 2)

    def training_step(self, batch: torch.Tensor, idx: int) -> torch.Tensor:
        return self.layer(batch).pow(2).mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


def test_idle_per_batch_hooks_are_skipped_and_the_others_still_run() -> None:
    """Lightning then skips the no-op hooks (not callable) and still calls the overridden one."""
    counts, idle = skip_idle_hooks([_Counts(), L.Callback()])
    assert callable(counts.on_train_batch_end)
    assert not callable(counts.on_before_zero_grad)
    assert not any(callable(getattr(idle, hook)) for hook in PER_BATCH_HOOKS)
    assert callable(idle.on_train_epoch_end)  # not a per-batch hook: untouched
    trainer = L.Trainer(
        accelerator="cpu", max_steps=5, callbacks=[counts, idle], logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    trainer.fit(_Tiny(), DataLoader(torch.randn(8, 2), batch_size=1))
    assert counts.ends == 5


def test_the_run_trainers_callbacks_skip_their_idle_hooks(tmp_path) -> None:
    cfg = parse_config([f"--output_dir={tmp_path}", "--accelerator=cpu"])
    trainer = build_trainer(cfg, RankContext(), "T", {})
    dispatched = [
        type(cb).__name__
        for cb in trainer.callbacks
        if callable(getattr(cb, "on_before_zero_grad", None))
    ]
    assert dispatched == []  # no callback of the run does anything there
