"""What happens when an optimizer step has finished, in the order it happens.

Lightning calls `on_train_batch_end` after every training batch. With gradient accumulation
(`--gradient_accumulation_steps=A`) only every A-th batch, and the last batch of an epoch, ends
an optimizer step; `trainer.global_step` moves only then. `StepBoundary` is the one place that
tells the two apart. After an optimizer step it runs, in this order:

1. the EMA update (`ema.py`), so that what is saved or shown next includes this step;
2. the checkpoint, every `--checkpointing_period` steps, when the ranks agreed that
   `--checkpoint_minutes` have passed since the previous save, and after the last step
   (`checkpointing.py`);
3. the stop-signal check (`preemption.py`): when the ranks agreed that some rank got a stop
   signal, every rank saves (unless step 2 already saved this step) and the fit stops;
4. sampling, every `--sample_period` steps unless stopping (`sampling.py`): after the save, so
   that an out-of-memory error there can cost no checkpoint;
5. the per-rank series to the loggers, on rank 0 at their cadence (`rank_series.py`: read from
   the heartbeats, no collective);
6. whether this batch is validated: after every `--val_interval`-th step and at the last batch
   of an epoch, unless stopping (a preempted rank has no time for it).

Validation itself is Lightning's: the trainer asks after every batch (`val_check_interval=1`,
`check_val_every_n_epoch=None`) and runs it when validation is enabled, that is when
`trainer.limit_val_batches` (Lightning's own switch: 0 turns validation off) is above 0. This
callback sets it for every batch: the run's limit on a batch due for validation, 0 on every
other. A step that is due twice (an epoch end on an N-th step) validates once. Lightning's own
integer interval would count batches, not optimizer steps, restart every epoch and drop the
epoch-end validation; its float interval cannot add a cadence in steps.

Both agreements come from the step vote (`step_vote.py`): the answer of the vote cast a step
earlier is read before step 2, and after step 4 this rank's flags go into the next vote when one
is due (about four times a second), through the job's c10d store: no collective and no host
sync. In one process the rank's own flags decide, at every step.

The straggler look is not here: rank 0's watchdog thread judges the ranks from their heartbeats
(`ae.forensics.stragglers`), off the training thread and without a collective; the step clock it
reads is closed after every batch, accumulating ones included, by `ae.forensics.loop_tracer`.

Nothing here reads the device (no `.item()`, no sync): a batch that ends no step costs a few
comparisons and one attribute store; one that does, besides the work due, a clock read.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import lightning as L

from ae.training.checkpointing import Checkpointing
from ae.training.ema import EMA
from ae.training.preemption import Preemption, stop_signal_received
from ae.training.rank_series import RankSeries
from ae.training.sampling import Sampling
from ae.training.step_vote import Decision, StepVote

# What the validation gate needs of the Trainer: ask after every batch, not once per epoch.
TRAINER_VALIDATION_ARGS: dict[str, Any] = {"val_check_interval": 1, "check_val_every_n_epoch": None}


class StepBoundary(L.Callback):
    def __init__(
        self,
        *,
        ema: EMA | None,
        checkpointing: Checkpointing,
        preemption: Preemption,
        sampling: Sampling,
        rank_series: RankSeries | None = None,
        val_interval: int,
        vote: StepVote | None = None,
        vote_timeout: timedelta = timedelta(minutes=30),
    ) -> None:
        self.ema = ema
        self.checkpointing = checkpointing
        self.preemption = preemption
        self.sampling = sampling
        self.rank_series = rank_series
        self.val_interval = val_interval
        self.vote = vote if vote is not None else StepVote()
        self.vote_timeout = vote_timeout  # how long a vote may wait for a peer: --pg_timeout
        self.val_limit: int | float = 1.0  # the run's limit_val_batches, read at train start
        self.seen_step = -1  # global_step after the previous batch

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.seen_step = trainer.global_step
        self.val_limit = trainer.limit_val_batches
        # Closed until a batch is due. Lightning also asks before the first batch of a resumed
        # run, about the step it resumed at: the run that saved it validated it (or not) after
        # the save.
        trainer.limit_val_batches = 0
        self.vote.start(trainer.world_size, self.vote_timeout)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        trainer.limit_val_batches = self.val_limit  # a later trainer.validate() runs in full

    def _flags(self) -> Decision:
        """This rank's own: a stop signal received, the timed checkpoint due."""
        return Decision(stop=stop_signal_received(), save=self.checkpointing.timed_save_due())

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, idx: int
    ) -> None:
        step = trainer.global_step
        stepped = step != self.seen_step  # else accumulating gradients: no optimizer step
        if stepped:
            self.seen_step = step
            if self.ema is not None:
                self.ema.update(trainer, pl_module)
            agreed = self.vote.answer(step, self._flags)
            self.checkpointing.after_step(trainer, idx, step, agreed.save)
            self.preemption.after_step(trainer, agreed.stop)
            if not trainer.should_stop:
                self.sampling.after_step(trainer, pl_module)
                self.vote.cast(step, self._flags)
            if self.rank_series is not None:
                self.rank_series.after_step(trainer, step)
        due = not trainer.should_stop and (
            idx + 1 >= trainer.num_training_batches  # the epoch's last batch
            or (stepped and self.val_interval > 0 and step % self.val_interval == 0)
        )
        trainer.limit_val_batches = self.val_limit if due else 0
