"""The step boundary in a real Lightning fit (CPU, one process): what runs after an optimizer
step, in which order, only on batches that end one, and which batches are validated."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader

from ae.config import CheckpointConfig
from ae.run_paths import RunDir
from ae.training.checkpointing import Checkpointing
from ae.training.step_boundary import TRAINER_VALIDATION_ARGS, StepBoundary


class Tiny(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(2, 2)
        self.validated_at: list[int] = []

    def training_step(self, batch: torch.Tensor, idx: int) -> torch.Tensor:
        return self.layer(batch).pow(2).mean()

    def validation_step(self, batch: torch.Tensor, idx: int) -> None:
        if idx == 0:
            self.validated_at.append(self.trainer.global_step)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


class Recorded:
    """Stands in for the EMA, the checkpointing, the preemption or the sampling: records its
    calls; the preemption one stops the fit at `stop_at`, as a stop signal would."""

    def __init__(self, name: str, calls: list[tuple[str, int]], stop_at: int = -1) -> None:
        self.name, self.calls, self.stop_at = name, calls, stop_at

    def update(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.calls.append((self.name, trainer.global_step))

    def timed_save_due(self) -> bool:  # the checkpointing's clock: never due here
        return False

    def after_step(self, trainer: L.Trainer, *args: Any) -> None:
        self.calls.append((self.name, trainer.global_step))
        if trainer.global_step == self.stop_at:
            trainer.should_stop = True


def fit(
    *, accumulate: int, val_interval: int, max_steps: int, stop_at: int = -1
) -> tuple[list[tuple[str, int]], list[int], L.Trainer]:
    calls: list[tuple[str, int]] = []
    boundary = StepBoundary(
        ema=Recorded("ema", calls),  # type: ignore[arg-type]
        checkpointing=Recorded("checkpoint", calls),  # type: ignore[arg-type]
        preemption=Recorded("preemption", calls, stop_at),  # type: ignore[arg-type]
        sampling=Recorded("sampling", calls),  # type: ignore[arg-type]
        val_interval=val_interval,
    )
    model = Tiny()
    trainer = L.Trainer(
        accelerator="cpu", devices=1, max_steps=max_steps, accumulate_grad_batches=accumulate,
        callbacks=[boundary], logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
        **TRAINER_VALIDATION_ARGS,
    )  # fmt: skip
    data = torch.randn(8, 2)  # 8 batches of 1 an epoch
    trainer.fit(model, DataLoader(data, batch_size=1), DataLoader(data[:2], batch_size=1))
    return calls, model.validated_at, trainer


def test_order_after_each_optimizer_step_and_validation_steps() -> None:
    """The recipe's pins (tests/e2e/test_recipe.py) on one process: accumulation 2 makes 4
    optimizer steps an epoch; every 3 steps and each epoch end, once each."""
    calls, validated, trainer = fit(accumulate=2, val_interval=3, max_steps=10)
    per_step = ["ema", "checkpoint", "preemption", "sampling"]
    assert calls == [(name, step) for step in range(1, 11) for name in per_step]
    assert validated == [3, 4, 6, 8, 9]
    assert trainer.limit_val_batches == 1.0  # the switch is back as the fit found it


def test_epoch_ends_only_and_an_uneven_last_step() -> None:
    """Without --val_interval: the epoch ends alone. 8 batches with accumulation 3: the
    epoch's last optimizer step takes 2 batches, and the step count stays Lightning's."""
    calls, validated, _ = fit(accumulate=3, val_interval=0, max_steps=6)
    assert [s for name, s in calls if name == "checkpoint"] == [1, 2, 3, 4, 5, 6]
    assert validated == [3, 6]


@pytest.mark.parametrize("stop_at", [3, 4])
def test_a_stop_skips_sampling_and_validation(stop_at: int) -> None:
    """A stop signal at a step due for validation (3: periodic, 4: an epoch end): no sampling
    and no validation after it, and the fit ends there."""
    calls, validated, trainer = fit(accumulate=2, val_interval=3, max_steps=10, stop_at=stop_at)
    assert calls[-1] == ("preemption", stop_at) and ("sampling", stop_at) not in calls
    assert validated == [3][: int(stop_at > 3)]
    assert trainer.global_step == stop_at


@pytest.mark.parametrize(
    ("minutes", "step_s", "steps"),
    [({"checkpoint_minutes": 1}, 25.0, (3, 6, 9, 10)), ({}, 420.0, (5, 10))],
    ids=["one-minute", "default-30-minutes"],
)
def test_checkpoint_minutes_saves_at_the_first_step_after_m_minutes(
    tmp_path: Path, minutes: dict[str, float], step_s: float, steps: tuple[int, ...]
) -> None:
    """`--checkpoint_minutes=1` on a clock that moves 25 s a step: saves at steps 3, 6, 9 (the
    first boundary 60 s or more after the previous save), besides the final one at 10. By
    default a run saves every 30 minutes too (7-minute steps: at step 5), so a night's run killed
    before its first `--checkpointing_period` save loses at most half an hour."""
    cfg = CheckpointConfig(checkpointing_period=0, checkpoints_total_limit=10, **minutes)
    checkpointing = Checkpointing(cfg, RunDir(tmp_path), {}, config_yaml="")
    calls: list[tuple[str, int]] = []
    boundary = StepBoundary(
        ema=None, checkpointing=checkpointing,
        preemption=Recorded("preemption", calls),  # type: ignore[arg-type]
        sampling=Recorded("sampling", calls),  # type: ignore[arg-type]
        val_interval=0,
    )  # fmt: skip
    trainer = L.Trainer(
        accelerator="cpu", devices=1, max_steps=10, callbacks=[boundary, checkpointing],
        logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0,
    )  # fmt: skip
    checkpointing.clock = lambda: trainer.global_step * step_s
    data = torch.randn(16, 2)
    trainer.fit(Tiny(), DataLoader(data, batch_size=1))
    saved = sorted(p.name for p in (tmp_path / "checkpoints").glob("step-*.ckpt"))
    assert saved == [f"step-{s:08d}.ckpt" for s in steps]
