"""The position arithmetic by property: seeded random sequences of stops and changes of settings,
each resumed through what a real resume runs (the data module's loader `resume`, the position's
`resumed_position` and `reconcile_fit_loop`, the LR re-plan's `steps_to_end`) and a model of
Lightning 2.x's restart (`lightning_resumes`, read from its `_TrainingEpochLoop.reset` and
`_FitLoop.reset`; tests/e2e/test_position.py checks the same against Lightning itself).

Covers 400 sequences of 2-5 launches (1,001 resumes; seeds 0-399): stops mid-epoch, after an epoch's
last batch and at the end, with changes of ranks (1-4), batch size, workers and max_epochs. Each
must train every epoch's samples exactly as often as its plans allow (all but the drop they
announce: the drop of its last plan, a re-split rest holding the samples an earlier plan of the
epoch left out) and end at the step its LR schedule announced. Without the rewrite of Lightning's
progress (reconcile_fit_loop as the identity) it fails: an end-of-epoch checkpoint resumed where
epochs are longer reads to Lightning as mid-epoch.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

from ae.data.stream.resume import ResumableLoader
from ae.training.lr import steps_to_end
from ae.training.position.arithmetic import EpochPosition, resumed_position
from ae.training.position.lightning_progress import (
    BATCH_PROGRESS,
    EPOCH_LOOP_STATE,
    EPOCH_PROGRESS,
    reconcile_fit_loop,
)
from tests.support.id_streams import make_stream

SEQUENCES = 400
COUNTS = [23, 17, 31, 9]  # four small shards: 80 samples
N = sum(COUNTS)


def saved_fit_loop(epoch: int, batch: int) -> dict[str, Any]:
    """Lightning's fit loop state as saved at the end of training batch `batch` (1-based count)
    of epoch `epoch`: the epoch started, the batch processed and not yet completed."""
    current = {"ready": batch, "started": batch, "processed": batch, "completed": batch - 1}
    epochs = {"ready": epoch + 1, "started": epoch + 1, "processed": epoch, "completed": epoch}
    return {
        BATCH_PROGRESS: {"current": current, "total": dict(current), "is_last_batch": False},
        EPOCH_PROGRESS: {"current": epochs, "total": dict(epochs)},
        EPOCH_LOOP_STATE: {"_batches_that_stepped": batch - 1},  # saved before it counts this one
    }


def lightning_logger_step(fit_loop: dict[str, Any]) -> int:
    """The loggers' step Lightning (2.6, `_TrainingEpochLoop.reset`) goes on from: the saved one,
    plus the batch being saved at unless the batch counters read "epoch ended" (all equal)."""
    total = fit_loop[BATCH_PROGRESS]["total"]
    ended = total["completed"] == total["processed"] == total["started"] == total["ready"]
    return fit_loop[EPOCH_LOOP_STATE]["_batches_that_stepped"] + (0 if ended else 1)


def lightning_resumes(fit_loop: dict[str, Any], length: int) -> tuple[int, int]:
    """(epoch, batch) where Lightning goes on from a fit loop state, its epoch now `length`
    batches long: an epoch whose counters are all equal has ended (the next starts at batch 0);
    else the restarted batch counts as completed, and an epoch whose completed batches reach its
    length is over."""
    epochs = fit_loop[EPOCH_PROGRESS]["current"]
    current = fit_loop[BATCH_PROGRESS]["current"]
    if epochs["processed"] == epochs["ready"]:
        return epochs["processed"], 0
    if current["completed"] + 1 >= length:
        return epochs["processed"] + 1, 0
    return epochs["processed"], current["processed"]


@dataclass
class Run:
    """One run folder over a sequence of launches."""

    max_epochs: int
    position: dict[str, Any] | None = None  # the data module's, in the newest checkpoint
    saved_epoch: int = 0
    saved_batch: int = 0
    next_epoch: int = 0  # the epoch the next launch trains in first
    step: int = 0
    trained: dict[int, int] = field(default_factory=dict)  # epoch -> samples trained
    dropped: dict[int, int] = field(default_factory=dict)  # epoch -> samples its plans dropped

    def launch(self, rng: random.Random, settings: dict[str, int], stop: int | None) -> int:
        """Resume (if a checkpoint exists) with `settings`, train `stop` steps (None: to the
        end); returns the step the LR schedule announced for the run's end."""
        stream = make_stream(["x"] * len(COUNTS), COUNTS, shuffle=True, shuffle_buffer=8,
                             rank=0, **settings)  # fmt: skip
        loader = ResumableLoader(stream, batch_size=None, num_workers=0)
        ranks, batch = settings["world_size"], settings["batch_size"]
        epoch, k = 0, 0
        if self.position is not None:
            resume = loader.resume(self.position)
            length = len(loader)
            at: EpochPosition = resumed_position(
                saved_epoch=resume.saved_epoch, resume_epoch=resume.epoch,
                batches=resume.offset + resume.skip, length=length,
                samples=resume.trained_samples(ranks, batch),
            )  # fmt: skip
            fit = reconcile_fit_loop(saved_fit_loop(self.saved_epoch, self.saved_batch), at)
            epoch, k = lightning_resumes(fit, length)
            if resume.base is not None:  # a re-split rest: it holds the old plan's drop
                self.dropped[resume.epoch] = stream.plan().dropped
            elif resume.dropped:  # a rest too small for one batch of the new plan: left out
                self.dropped[resume.saved_epoch] = resume.dropped
        if epoch >= self.max_epochs:  # nothing left to train: Lightning skips the fit
            return self.step
        # The LR re-plan, as the model's `replan_schedule` does once the loops are restored.
        stream.epoch = epoch
        loader.forget_resume_before(epoch)
        whole = self._whole(stream)
        end = self.step + steps_to_end(
            done=k, epoch_len=len(loader), full_len=whole, epoch=epoch,
            max_epochs=self.max_epochs, accumulation=1,
        )  # fmt: skip
        while epoch < self.max_epochs:
            stream.epoch = epoch
            loader.forget_resume_before(epoch)
            length = len(loader)
            if k == 0:  # a fresh epoch: its plan's drop
                self.dropped[epoch] = stream.plan().dropped  # the rest holds the old drop
            todo = length - k if stop is None else min(length - k, stop)
            self.trained[epoch] = self.trained.get(epoch, 0) + todo * ranks * batch
            k += todo
            self.step += todo
            if stop is not None:
                stop -= todo
            self.position = loader.position(k)
            self.saved_epoch, self.saved_batch = epoch, k
            self.next_epoch = epoch + (k == length)
            if stop == 0 and k < length:
                return end  # stopped mid-epoch
            if stop == 0:
                return end  # stopped after the epoch's last batch
            epoch, k = epoch + 1, 0
        return end

    @staticmethod
    def _whole(stream: Any) -> int:
        saved = stream.resumed
        stream.resumed = False
        whole = len(stream)
        stream.resumed = saved
        return whole


def random_settings(rng: random.Random) -> dict[str, int]:
    return {
        "world_size": rng.choice([1, 2, 2, 3, 4]),
        "batch_size": rng.choice([2, 3, 4, 5, 8]),
        "num_workers": rng.choice([1, 2, 3]),
    }


def run_sequence(seed: int) -> tuple[Run, int, int]:
    """A seeded sequence of launches; returns the run, its last launch's announced end and the
    number of resumes."""
    rng = random.Random(seed)
    run = Run(max_epochs=rng.randint(1, 3))
    resumes = 0
    for _ in range(rng.randint(1, 4)):
        settings = random_settings(rng)
        length = len(make_stream(["x"] * len(COUNTS), COUNTS, rank=0, **settings))
        kind = rng.choice(["mid", "epoch end", "mid"])
        stop = rng.randint(1, 2 * length) if kind == "mid" else length - run.saved_batch
        if run.next_epoch >= run.max_epochs:
            run.max_epochs = run.next_epoch + 1  # a later launch asks for one more epoch
        run.launch(rng, settings, max(1, stop))
        resumes += run.position is not None
    run.max_epochs = max(run.max_epochs, run.next_epoch + 1) + rng.randint(0, 1)
    end = run.launch(rng, random_settings(rng), None)
    return run, end, resumes + 1


def test_random_sequences_train_each_epoch_once_and_end_at_the_announced_step() -> None:
    resumes = 0
    for seed in range(SEQUENCES):
        run, end, n = run_sequence(seed)
        resumes += n
        assert run.step == end, f"seed {seed}: ended at step {run.step}, announced {end}"
        for epoch in range(run.max_epochs):
            got = run.trained.get(epoch, 0) + run.dropped.get(epoch, 0)
            assert got == N, f"seed {seed}, epoch {epoch}: trained + dropped {got} of {N} samples"
    assert resumes > 3 * SEQUENCES


def test_an_end_of_epoch_checkpoint_on_longer_epochs_starts_the_next_epoch() -> None:
    """The issue's first case in small: saved after batch 37 of 37 in epoch 1, resumed where an
    epoch has 75 batches: Lightning must start epoch 2, not go on at batch 37 of 75."""
    at = resumed_position(saved_epoch=1, resume_epoch=2, batches=0, length=75, samples=0)
    fit = reconcile_fit_loop(saved_fit_loop(1, 37), at)
    assert lightning_resumes(fit, 75) == (2, 0)
    assert fit[EPOCH_PROGRESS]["current"] == dict.fromkeys(
        ("ready", "started", "processed", "completed"), 2
    )
    assert lightning_resumes(saved_fit_loop(1, 37), 75) == (1, 37)  # what Lightning did alone
    # the loggers' step goes on from the optimizer's (37 steps done), not one behind it
    assert lightning_logger_step(fit) == 37 == lightning_logger_step(saved_fit_loop(1, 37))
    # mid-epoch: ae's count stands; the counters keep their distance
    mid = resumed_position(saved_epoch=1, resume_epoch=1, batches=20, length=75, samples=320)
    fit = reconcile_fit_loop(saved_fit_loop(1, 37), mid)
    assert fit[BATCH_PROGRESS]["current"] == {
        "ready": 20, "started": 20, "processed": 20, "completed": 19,
    }  # fmt: skip
    assert lightning_resumes(fit, 75) == (1, 20)
    assert lightning_logger_step(fit) == 37  # steps done stay steps done
    # a checkpoint of a run whose resumed epoch Lightning counted as mid-epoch (all its epoch
    # counters equal): rewritten to mid-epoch, not read as ended
    odd = saved_fit_loop(2, 10)
    odd[EPOCH_PROGRESS]["current"] = dict.fromkeys(
        ("ready", "started", "processed", "completed"), 2
    )
    mid = resumed_position(saved_epoch=2, resume_epoch=2, batches=10, length=30, samples=40)
    assert lightning_resumes(odd, 30) == (2, 0)  # Lightning alone: the epoch from its start
    assert lightning_resumes(reconcile_fit_loop(odd, mid), 30) == (2, 10)
