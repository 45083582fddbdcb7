"""The non-finite guard in a real single-process fit: a NaN loss is named with its step and
batch, `skip` leaves the weights as they were and goes on, `stop` raises; the save guard's check
finds the first non-finite tensor; the sample description names non-finite inputs alone."""

from __future__ import annotations

from pathlib import Path

import lightning as L
import pytest
import torch
from loguru import logger
from torch import nn
from torch.utils.data import DataLoader

from ae.config import CheckpointConfig, OptimConfig
from ae.data.stream.batch_members import Member
from ae.training.checkpoint_files import CheckpointStore
from ae.training.nonfinite import NonFiniteError, NonFiniteGuard, describe_members, nonfinite_in

NAN_BATCH = 3  # the 4th batch holds a NaN: optimizer step 4


class Tiny(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Linear(4, 4)
        self.weights: dict[int, torch.Tensor] = {}  # after each optimizer step

    def training_step(self, batch: torch.Tensor, idx: int) -> torch.Tensor:
        return ((self.net(batch) - batch) ** 2).mean()

    def on_train_batch_end(self, outputs, batch, idx) -> None:
        self.weights[self.trainer.global_step] = self.net.weight.detach().clone()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=0.1)


@pytest.fixture
def caplog_lines():
    """The messages loguru writes meanwhile."""
    lines: list[str] = []
    sink = logger.add(lambda m: lines.append(m.record["message"]), level="INFO")
    yield lines
    logger.remove(sink)


def batches() -> list[torch.Tensor]:
    out = [torch.rand(2, 4) for _ in range(8)]
    out[NAN_BATCH][1, 2] = float("nan")
    return out


def fit(tmp_path: Path, mode: str) -> tuple[Tiny, NonFiniteGuard]:
    guard = NonFiniteGuard(
        OptimConfig(on_nonfinite=mode, max_skipped_steps=1), CheckpointConfig(),
        CheckpointStore(tmp_path, 3), "32",
    )  # fmt: skip
    model = Tiny()
    trainer = L.Trainer(
        accelerator="cpu", max_epochs=1, callbacks=[guard], logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        default_root_dir=tmp_path,
    )  # fmt: skip
    trainer.fit(model, train_dataloaders=DataLoader(batches(), batch_size=None))
    return model, guard


def test_skip_leaves_the_weights_of_the_nan_step_and_goes_on(tmp_path: Path, caplog_lines) -> None:
    model, guard = fit(tmp_path, "skip")
    assert guard.skipped == 1
    step = NAN_BATCH + 1
    assert torch.equal(model.weights[step], model.weights[step - 1])  # not applied
    assert not torch.equal(model.weights[step + 1], model.weights[step])  # and on it went
    assert all(torch.isfinite(w).all() for w in model.weights.values())
    [line] = [m for m in caplog_lines if m.startswith("NONFINITE")]
    assert line.startswith(f"NONFINITE loss=nan on rank 0 at step {step} (epoch 0, batch 3): ")


def test_stop_raises_at_the_nan_step(tmp_path: Path) -> None:
    with pytest.raises(NonFiniteError, match=f"step {NAN_BATCH + 1}"):
        fit(tmp_path, "stop")


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


def test_a_finite_loss_far_above_its_mean_is_a_spike(tmp_path: Path, caplog_lines) -> None:
    data = [torch.full((2, 4), 0.5) for _ in range(40)]
    data[30] = torch.full((2, 4), 50.0)  # step 31: a loss ~10^4 times the others
    guard = NonFiniteGuard(OptimConfig(), CheckpointConfig(), CheckpointStore(tmp_path, 3), "32")
    trainer = L.Trainer(
        accelerator="cpu", max_epochs=1, callbacks=[guard], logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        default_root_dir=tmp_path,
    )  # fmt: skip
    torch.manual_seed(0)  # the same weights every time: the steps after the spike are calm
    trainer.fit(Tiny(), train_dataloaders=DataLoader(data, batch_size=None))
    assert guard.events == [(31, "loss spike")]
    [line] = [m for m in caplog_lines if m.startswith("LOSS SPIKE")]
    assert " on rank 0 at step 31 (epoch 0, batch 30), " in line


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


def test_the_clipping_uses_the_guards_norm_and_clips_as_lightning_does(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The guard measures each step's gradient norm; the clipping takes it rather than measure
    again (one pass over the gradients a step, not two), with the weights Lightning's own
    clipping gives."""
    from ae.config import ModelConfig
    from ae.data.decoding.decode import InputSpec
    from ae.training.model import AutoEncoder

    def counted(name: str) -> list[int]:
        calls: list[int] = []
        real = getattr(torch.nn.utils, name)
        monkeypatch.setattr(torch.nn.utils, name, lambda *a, **k: calls.append(1) or real(*a, **k))
        return calls

    norms, clipped = counted("get_total_norm"), counted("clip_grad_norm_")
    data = [torch.rand(8, 12, generator=torch.Generator().manual_seed(i)) for i in range(6)]

    def weights(with_guard: bool) -> list[torch.Tensor]:
        torch.manual_seed(0)
        model = AutoEncoder(InputSpec("vector", (12,)), ModelConfig(hidden_dim=16, latent_dim=3),
                            OptimConfig(learning_rate=0.05, warmup_steps=0))  # fmt: skip
        guard = NonFiniteGuard(
            OptimConfig(), CheckpointConfig(), CheckpointStore(tmp_path, 3), "32"
        )
        trainer = L.Trainer(
            accelerator="cpu", max_epochs=1, gradient_clip_val=0.01, logger=False,
            callbacks=[guard] if with_guard else [], enable_checkpointing=False,
            enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path,
        )  # fmt: skip
        trainer.fit(model, train_dataloaders=DataLoader(data, batch_size=None))
        return [p.detach().clone() for p in model.parameters()]

    guarded = weights(with_guard=True)
    assert len(norms) == len(data) and not clipped  # one norm a step, Lightning's clip unused
    lightnings = weights(with_guard=False)
    assert len(clipped) == len(data)
    assert all(torch.allclose(a, b, atol=1e-7) for a, b in zip(guarded, lightnings, strict=True))
