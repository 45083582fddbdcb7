"""When validation runs: at every epoch end, and every `--val_interval` optimizer steps.

Lightning's own knobs cannot say this: an integer `val_check_interval` counts *batches* (not
optimizer steps, so it silently changes meaning with gradient accumulation), restarts its count
every epoch, and then skips the epoch-end validation unless the epoch length is a multiple of
it. So the trainer keeps Lightning's epoch-end validation (`val_check_interval=1.0`) and this
callback widens the training loop's decision, `_should_check_val_fx`, the one method Lightning
consults after every batch, to also say yes after every N-th optimizer step (counted globally,
so the cadence survives epochs and resumes). It also says no once training is stopping: Lightning
would otherwise validate before honoring `trainer.should_stop`, which a preempted job has no time
for. `tests/test_e2e_recipe.py` pins this behaviour, so a Lightning upgrade that moves the hook
fails loudly instead of silently validating less.
"""

from __future__ import annotations

from typing import Any

import lightning as L


class ValidationSchedule(L.Callback):
    def __init__(self, every_n_steps: int) -> None:
        self.every = every_n_steps

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        loop = trainer.fit_loop.epoch_loop
        lightning_decision = loop._should_check_val_fx

        def should_check_val(data_fetcher: Any) -> bool:
            if trainer.should_stop:
                return False
            if lightning_decision(data_fetcher):  # epoch end
                return True
            stepped = not loop._should_accumulate()
            return (
                self.every > 0
                and stepped
                and trainer.enable_validation
                and trainer.global_step % self.every == 0
            )

        loop._should_check_val_fx = should_check_val
