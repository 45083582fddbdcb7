"""The trainer refuses a precision its device cannot do, rather than running another."""

from __future__ import annotations

from typing import Any

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader

from ae.config import ConfigError, RunConfig, parse_config
from ae.training.batch_hooks import PER_BATCH_HOOKS, BatchHooks, route
from ae.training.trainer import build_trainer, check_precision
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


class _Calls(L.Callback):
    """Records its per-batch hooks in `log` (shared), and counts its epoch ends."""

    def __init__(self, name: str, log: list[tuple[str, str]]) -> None:
        self.name, self.calls = name, log
        self.epoch_ends = 0

    def on_train_batch_start(self, trainer: L.Trainer, *args: Any) -> None:
        self.calls.append((self.name, "start"))

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        self.calls.append((self.name, "end"))

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.epoch_ends += 1


class _Tiny(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(2, 2)

    def training_step(self, batch: torch.Tensor, idx: int) -> torch.Tensor:
        return self.layer(batch).pow(2).mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


def test_per_batch_hooks_reach_the_callbacks_through_one_in_their_order() -> None:
    """Lightning dispatches each per-batch hook once, to BatchHooks, which calls the callbacks'
    own in their order; their other hooks are still Lightning's to call."""
    log: list[tuple[str, str]] = []
    first, second, idle = _Calls("first", log), _Calls("second", log), L.Callback()
    callbacks = route([first, second, idle])
    hooks = callbacks[-1]
    assert isinstance(hooks, BatchHooks) and callbacks[:-1] == [first, second, idle]
    for cb in (first, second, idle):  # Lightning skips what is not callable
        assert not any(callable(getattr(cb, hook)) for hook in PER_BATCH_HOOKS)
    assert callable(hooks.on_train_batch_end) and callable(hooks.on_train_batch_start)
    assert not callable(hooks.on_before_zero_grad)  # no callback works there
    assert callable(first.on_train_epoch_end)  # not a per-batch hook: untouched
    trainer = L.Trainer(
        accelerator="cpu", max_steps=5, max_epochs=1, callbacks=callbacks, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    trainer.fit(_Tiny(), DataLoader(torch.randn(5, 2), batch_size=1))
    one_batch = [("first", "start"), ("second", "start"), ("first", "end"), ("second", "end")]
    assert log == one_batch * 5
    assert first.epoch_ends == second.epoch_ends == 1


def test_the_run_trainers_callbacks_take_their_per_batch_hooks_through_one(tmp_path) -> None:
    cfg = parse_config([f"--output_dir={tmp_path}", "--accelerator=cpu"])
    trainer = build_trainer(cfg, RankContext(), "T", {})
    dispatched = {
        type(cb).__name__
        for cb in trainer.callbacks
        for hook in PER_BATCH_HOOKS
        if callable(getattr(cb, hook, None))
    }
    assert dispatched == {"BatchHooks"}
    (hooks,) = [cb for cb in trainer.callbacks if isinstance(cb, BatchHooks)]
    ends = [type(fn.__self__).__name__ for fn in hooks.calls["on_train_batch_end"]]
    # the order the step boundary's docstring and the data callbacks rely on
    assert ends.index("EpochSync") < ends.index("BadDataBound") < ends.index("NonFiniteGuard")
    assert ends.index("NonFiniteGuard") < ends.index("StepBoundary") < ends.index("LearningRates")
    assert "on_before_zero_grad" not in hooks.calls


def test_lightning_clips_no_gradients_of_a_model_that_optimizes_manually(tmp_path) -> None:
    """Lightning refuses `gradient_clip_val` for manual optimization at the run's start."""
    cfg = parse_config([f"--output_dir={tmp_path}", "--accelerator=cpu"])
    assert build_trainer(cfg, RankContext(), "T", {}).gradient_clip_val == 1.0
    manual = build_trainer(cfg, RankContext(), "T", {}, manual_optimization=True)
    assert manual.gradient_clip_val is None
