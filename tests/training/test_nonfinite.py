"""The non-finite guard in a real single-process fit: a NaN loss is named with its step and
batch, `skip` leaves the weights as they were and goes on (out of the epoch's mean loss),
`stop` raises; an injected NaN names the step it poisons; a loss spike is marked; the
clipping takes the guard's gradient norm."""

from __future__ import annotations

import math
from pathlib import Path

import lightning as L
import pytest
import torch
from loguru import logger
from torch.utils.data import DataLoader

from ae.config import CheckpointConfig, OptimConfig
from ae.training.checkpoint_files import CheckpointStore
from ae.training.nonfinite import NonFiniteError, NonFiniteGuard
from tests.training.tiny_linear_module import Tiny

NAN_BATCH = 3  # the 4th batch holds a NaN: optimizer step 4


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


def fit(
    tmp_path: Path, mode: str, data: list[torch.Tensor] | None = None,
    checkpoints: CheckpointConfig | None = None,
) -> tuple[Tiny, NonFiniteGuard]:  # fmt: skip
    guard = NonFiniteGuard(
        OptimConfig(on_nonfinite=mode, max_skipped_steps=1), checkpoints or CheckpointConfig(),
        CheckpointStore(tmp_path, 3), "32",
    )  # fmt: skip
    model = Tiny()
    trainer = L.Trainer(
        accelerator="cpu", max_epochs=1, callbacks=[guard], logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        default_root_dir=tmp_path,
    )  # fmt: skip
    data = batches() if data is None else data
    trainer.fit(model, train_dataloaders=DataLoader(data, batch_size=None))
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
    with pytest.raises(NonFiniteError, match=f"step {NAN_BATCH + 1}") as stopped:
        fit(tmp_path, "stop")
    # Nothing survived under stop, and nothing is said to have (`0 of at most 10 survived`)
    assert f"step {NAN_BATCH + 1} (--on_nonfinite=stop): " in str(stopped.value)
    # Was: nothing of how to go on, when a plain resume meets the same NaN again
    assert str(stopped.value).endswith(
        "\n  To go on past it: --resume_from_checkpoint=last with --on_nonfinite=skip (or "
        "rollback), or with its cause fixed (samples holding NaN/Inf, a learning rate too high)"
    )


def test_skip_past_its_limit_says_so(tmp_path: Path) -> None:
    data = batches()
    data[NAN_BATCH + 2][0, 0] = float("nan")  # the second NaN step, past --max_skipped_steps=1
    with pytest.raises(NonFiniteError) as stopped:
        fit(tmp_path, "skip", data)
    assert f"step {NAN_BATCH + 3} (--on_nonfinite=skip; 1 of at most 1 steps skipped already " in (
        str(stopped.value)
    )
    assert "To go on past it: --resume_from_checkpoint=last with a higher --max_skipped_steps" in (
        str(stopped.value)
    )


@pytest.mark.parametrize(
    ("period", "minutes", "hint"),
    [
        (500, 0.0, "(set --checkpointing_period lower)"),
        # Was: "set --checkpointing_period lower", of a period of 0 (at the end only)
        (0, 0.0, "(--checkpointing_period=0 saves at the end only: set a period)"),
        (0, 30.0, "(set --checkpointing_period, or --checkpoint_minutes lower)"),
    ],
)
def test_rollback_before_any_checkpoint_says_what_to_change(
    tmp_path: Path, period: int, minutes: float, hint: str
) -> None:
    saves = CheckpointConfig(checkpointing_period=period, checkpoint_minutes=minutes)
    with pytest.raises(NonFiniteError) as stopped:
        fit(tmp_path, "rollback", checkpoints=saves)
    assert str(stopped.value) == (
        f"non-finite value at step {NAN_BATCH + 1}: --on_nonfinite=rollback has no checkpoint to "
        f"go back to yet {hint}"
    )


def test_the_skip_budget_spans_a_resume(tmp_path: Path) -> None:
    """Was: each resume (a requeue, a restart) started --max_skipped_steps afresh, so a run that
    keeps turning NaN went on past it, a few skips per requeue."""

    def trainer(guard: NonFiniteGuard, epochs: int) -> L.Trainer:
        return L.Trainer(
            accelerator="cpu", max_epochs=epochs, callbacks=[guard], logger=False,
            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
            default_root_dir=tmp_path,
        )  # fmt: skip

    def guard() -> NonFiniteGuard:
        return NonFiniteGuard(
            OptimConfig(on_nonfinite="skip", max_skipped_steps=1), CheckpointConfig(),
            CheckpointStore(tmp_path, 3), "32",
        )  # fmt: skip

    first, model = trainer(guard(), 1), Tiny()
    first.fit(model, train_dataloaders=DataLoader(batches(), batch_size=None))
    first.save_checkpoint(tmp_path / "after.ckpt")
    resumed = guard()
    with pytest.raises(NonFiniteError, match="1 of at most 1 steps skipped already"):
        trainer(resumed, 2).fit(Tiny(), train_dataloaders=DataLoader(batches(), batch_size=None),
                                ckpt_path=tmp_path / "after.ckpt")  # fmt: skip
    assert resumed.skipped == 1


class Losses(L.Callback):
    """Each batch's loss as training_step returned it."""

    def __init__(self) -> None:
        self.seen: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, idx) -> None:
        self.seen.append(float(outputs["loss"]))


def test_the_epoch_mean_leaves_out_the_skipped_step(tmp_path: Path) -> None:
    """A run that skipped its NaN step reported `train/loss_epoch=nan` (the NaN was in the
    mean): the mean is over the steps applied."""
    from ae.config import ModelConfig
    from ae.data.decoding.decode import InputSpec
    from ae.training.model import AutoEncoder

    torch.manual_seed(0)
    model = AutoEncoder(InputSpec("vector", (4,)), ModelConfig(hidden_dim=8, latent_dim=2))
    guard = NonFiniteGuard(OptimConfig(on_nonfinite="skip"), CheckpointConfig(),
                           CheckpointStore(tmp_path, 3), "32")  # fmt: skip
    losses = Losses()
    trainer = L.Trainer(
        accelerator="cpu", max_epochs=1, callbacks=[guard, losses], logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        default_root_dir=tmp_path,
    )  # fmt: skip
    trainer.fit(model, train_dataloaders=DataLoader(batches(), batch_size=None))
    assert guard.skipped == 1 and math.isnan(losses.seen[NAN_BATCH])
    kept = [x for i, x in enumerate(losses.seen) if i != NAN_BATCH]
    mean = trainer.callback_metrics["train/loss_epoch"]
    assert float(mean) == pytest.approx(sum(kept) / len(kept))


def test_an_injected_nan_names_the_step_its_nonfinite_line_names(
    tmp_path: Path, caplog_lines, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`nan@train:step=2` fires at global step 2 (2 optimizer steps done, as the key says): the
    batch of optimizer step 3, which the NONFINITE line names. The FAULT line said only `at step
    2`, beside `NONFINITE ... at step 3`; it names the step it poisons now."""
    from ae.config import ModelConfig
    from ae.data.decoding.decode import InputSpec
    from ae.forensics import faults
    from ae.log_lines import FAULT_INJECTED, NONFINITE
    from ae.training.model import AutoEncoder

    monkeypatch.setattr(faults, "_faults", faults.parse_faults("nan@train:step=2"))
    monkeypatch.setattr(faults, "_fired", set())
    monkeypatch.setenv("RANK", "0")
    model = AutoEncoder(InputSpec("vector", (4,)), ModelConfig(hidden_dim=8, latent_dim=2))
    guard = NonFiniteGuard(OptimConfig(on_nonfinite="skip"), CheckpointConfig(),
                           CheckpointStore(tmp_path, 3), "32")  # fmt: skip
    trainer = L.Trainer(
        accelerator="cpu", max_steps=4, callbacks=[guard], logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        default_root_dir=tmp_path,
    )  # fmt: skip
    data = [torch.rand(2, 4) for _ in range(4)]
    trainer.fit(model, train_dataloaders=DataLoader(data, batch_size=None))
    [fault] = [m for line in caplog_lines if (m := FAULT_INJECTED.parse(line))]
    [named] = [m for line in caplog_lines if (m := NONFINITE.parse(line))]
    assert (fault["step"], named["step"], guard.events) == ("2", "3", [(3, "non-finite")])
    assert fault["effect"] == ": the loss of optimizer step 3 turns NaN"


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
