"""`train/loss_epoch` across a resume: the epoch's sum and count so far travel in every step
checkpoint (reduced over the ranks at the save) and are counted once, on one rank, by the resumed
run, whatever its number of ranks; an older checkpoint without them still resumes; a rollback's
reload leaves the epoch's sum as the process has it."""

from __future__ import annotations

from pathlib import Path

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader

from ae.config import CheckpointConfig, ModelConfig, OptimConfig
from ae.data.decoding.decode import InputSpec
from ae.training.checkpoint_files import CheckpointStore
from ae.training.epoch_loss import CHECKPOINT_KEY, EpochLoss
from ae.training.model import AutoEncoder
from ae.training.nonfinite import NonFiniteGuard

CPU = torch.device("cpu")
BATCHES = 8
SAVE_AT = 3  # the step checkpoint the resumed run starts from: mid-epoch


def batches() -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return [torch.rand(2, 4, generator=gen) for _ in range(BATCHES)]


class Losses(L.Callback):
    """Each batch's loss as training_step returned it; a step checkpoint at `save_at`, taken
    where ae takes them (at a batch's end, after the optimizer step)."""

    def __init__(self, save_at: Path | None = None) -> None:
        self.seen: list[float] = []
        self.save_at = save_at

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, idx) -> None:
        self.seen.append(float(outputs["loss"]))
        if self.save_at is not None and trainer.global_step == SAVE_AT:
            trainer.save_checkpoint(self.save_at)


def model() -> AutoEncoder:
    return AutoEncoder(InputSpec("vector", (4,)), ModelConfig(hidden_dim=8, latent_dim=2))


def trainer(tmp_path: Path, callbacks: list[L.Callback], **kw) -> L.Trainer:
    return L.Trainer(
        accelerator="cpu", max_epochs=1, callbacks=callbacks, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        default_root_dir=tmp_path, **kw,
    )  # fmt: skip


def test_a_resumed_epochs_mean_covers_the_steps_before_the_resume(tmp_path: Path) -> None:
    """Stopped after step 3 and resumed from its checkpoint: the epoch's mean is over all 8
    batches, not the 5 trained since the resume."""
    ckpt = tmp_path / "step-3.ckpt"
    torch.manual_seed(0)
    first = Losses(save_at=ckpt)
    trainer(tmp_path, [first], max_steps=SAVE_AT).fit(
        model(), train_dataloaders=DataLoader(batches(), batch_size=None)
    )
    saved = torch.load(ckpt, weights_only=True)[CHECKPOINT_KEY]  # plain data: the safe loader
    assert saved["count"] == SAVE_AT
    assert saved["total"] == pytest.approx(sum(first.seen))

    second = Losses()
    resumed = trainer(tmp_path, [second])
    resumed.fit(model(), train_dataloaders=DataLoader(batches(), batch_size=None), ckpt_path=ckpt)
    assert len(first.seen) + len(second.seen) == BATCHES  # the epoch's rest, and no more
    everything = first.seen + second.seen
    mean = resumed.callback_metrics["train/loss_epoch"]
    assert float(mean) == pytest.approx(sum(everything) / BATCHES, rel=1e-6)


def test_a_checkpoint_without_the_epochs_sum_still_resumes(tmp_path: Path) -> None:
    """A checkpoint of older code: the mean is then over the steps since the resume."""
    ckpt = tmp_path / "step-3.ckpt"
    torch.manual_seed(0)
    trainer(tmp_path, [Losses(save_at=ckpt)], max_steps=SAVE_AT).fit(
        model(), train_dataloaders=DataLoader(batches(), batch_size=None)
    )
    old = torch.load(ckpt, weights_only=True)
    del old[CHECKPOINT_KEY]
    torch.save(old, ckpt)
    second = Losses()
    resumed = trainer(tmp_path, [second])
    resumed.fit(model(), train_dataloaders=DataLoader(batches(), batch_size=None), ckpt_path=ckpt)
    mean = resumed.callback_metrics["train/loss_epoch"]
    assert float(mean) == pytest.approx(sum(second.seen) / len(second.seen), rel=1e-6)


def ranks_add(ranks: list[EpochLoss], losses: list[list[float]], first_step: int) -> None:
    """Each rank trains its list of batch losses, one optimizer step per batch."""
    for rank, mine in zip(ranks, losses, strict=True):
        for i, loss in enumerate(mine):
            rank.add(torch.tensor(loss), first_step + i)


def saved(ranks: list[EpochLoss], step: int) -> dict:
    """What every rank's save after `step` writes: each rank's own part, summed as the
    all-reduce would (the save is collective: all ranks take part)."""
    parts: list[torch.Tensor] = []
    for rank in ranks:
        rank.state_dict(step, lambda t: parts.append(t) or t, CPU)
    return ranks[0].state_dict(step, lambda t: sum(parts), CPU)


def test_the_epochs_sum_carries_over_to_another_number_of_ranks() -> None:
    """2 ranks save after 3 steps each (all ranks' steps, summed at the save); 3 ranks resume
    and train 2 steps each: the mean of the ranks' shares, weighted by their counts, is the mean
    over all 12 batches, the part before the resume counted once."""
    before = [[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]]
    old = [EpochLoss(), EpochLoss()]
    ranks_add(old, before, 0)
    state = saved(old, 3)
    assert state == {"total": 21.0, "count": 6}

    new = [EpochLoss() for _ in range(3)]
    for rank, loss in enumerate(new):
        loss.load_state_dict(state, counted_here=rank == 0)
    after = [[7.0, 8.0], [9.0, 10.0], [11.0, 12.0]]
    ranks_add(new, after, 3)
    parts = [r.share(CPU) for r in new]
    assert all(p is not None for p in parts)
    total = sum(float(m) * n for m, n in parts)  # what Lightning's weighted sync computes
    count = sum(n for _, n in parts)
    assert (count, total / count) == (12, pytest.approx(6.5))

    # A second save in the same epoch carries the whole of it again, counted once.
    assert saved(new, 5) == {"total": 78.0, "count": 12}


def test_a_rank_with_only_dropped_steps_after_the_resume_still_takes_part() -> None:
    """Every step since the resume dropped: the ranks that do not count the carried part have
    nothing of their own, yet every rank has a share (a rank that did not log would leave the
    others waiting in the sync); the mean is the part before the resume."""
    state = {"total": 6.0, "count": 3}
    ranks = [EpochLoss(), EpochLoss()]
    for rank, loss in enumerate(ranks):
        loss.load_state_dict(state, counted_here=rank == 0)
        loss.add(torch.tensor(float("nan")), 9)
        loss.drop_step()
    parts = [r.share(CPU) for r in ranks]
    assert parts[1] is not None and parts[1][1] == 0
    assert parts[0] is not None and (float(parts[0][0]), parts[0][1]) == (2.0, 3)
    # A new epoch starts from nothing: the carried part was the last epoch's.
    ranks[0].start()
    assert ranks[0].share(CPU) is None


def test_a_step_still_accumulating_at_a_save_is_left_to_the_step() -> None:
    """Under gradient accumulation a save between a step's batches (a mid-epoch validation's
    `best.ckpt`) carries only the applied steps: the step under way may yet be dropped."""
    loss = EpochLoss()
    loss.add(torch.tensor(1.0), 0)
    loss.add(torch.tensor(3.0), 0)  # step 0 (the first optimizer step) applied: global step 1
    loss.add(torch.tensor(5.0), 1)  # step 1 under way: global step still 1
    assert loss.state_dict(1, lambda t: t, CPU) == {"total": 4.0, "count": 2}
    loss.add(torch.tensor(7.0), 1)
    assert loss.state_dict(2, lambda t: t, CPU) == {"total": 16.0, "count": 4}


def test_a_rollback_leaves_the_epochs_sum_as_the_process_has_it(tmp_path: Path) -> None:
    """A rollback reloads weights and optimizer state from the step-3 checkpoint, which carries
    the epoch's sum too: that sum is not added again (nor the running one reset to it). The
    mean is the skip's: every batch but the NaN step's."""
    data = batches()
    data[5][0, 0] = float("nan")  # step 6
    store = CheckpointStore(tmp_path / "ckpts", 3)
    store.prepare()
    guard = NonFiniteGuard(OptimConfig(on_nonfinite="rollback"), CheckpointConfig(), store, "32")
    torch.manual_seed(0)
    losses = Losses(save_at=store.step_path(SAVE_AT))
    run = trainer(tmp_path, [guard, losses])
    run.fit(model(), train_dataloaders=DataLoader(data, batch_size=None))
    assert guard.rollbacks == 1
    kept = [x for i, x in enumerate(losses.seen) if i != 5]
    mean = run.callback_metrics["train/loss_epoch"]
    assert float(mean) == pytest.approx(sum(kept) / len(kept), rel=1e-6)
