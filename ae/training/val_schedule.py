"""When validation runs: at every epoch end, and every `--val_interval` optimizer steps.

Lightning's own knobs cannot say this: an integer `val_check_interval` counts *batches* (not
optimizer steps, so it silently changes meaning with gradient accumulation), restarts its count
every epoch, and then skips the epoch-end validation unless the epoch length is a multiple of
it. So the trainer keeps Lightning's epoch-end validation (`val_check_interval=1.0`) and this
callback widens the training loop's decision, `_should_check_val_fx`, the one method Lightning
consults after every batch, to also say yes after every N-th optimizer step (counted globally,
so the cadence survives epochs and resumes). It also says no once training is stopping: Lightning
would otherwise validate before honoring `trainer.should_stop`, which a preempted job has no time
for. The hook is private: `check_lightning()` refuses a Lightning outside the versions it was
checked against (pyproject.toml pins the same range), and `tests/e2e/test_recipe.py` pins the
exact validation steps, so an upgrade that moves the hook fails loudly instead of silently
validating less.
"""

from __future__ import annotations

from typing import Any

import lightning as L

# Lightning releases whose `_TrainingEpochLoop._should_check_val_fx(data_fetcher)` and
# `_should_accumulate()` this callback was checked against (pyproject.toml: lightning < 2.7).
CHECKED_LIGHTNING = ((2, 4), (2, 6))


def check_lightning(version: str, loop: Any) -> None:
    """Fail at setup, naming the cause, when the private hook may have changed."""
    major_minor = tuple(int(p) for p in version.split(".")[:2])
    lo, hi = CHECKED_LIGHTNING
    missing = [n for n in ("_should_check_val_fx", "_should_accumulate") if not hasattr(loop, n)]
    if not lo <= major_minor <= hi or missing:
        raise RuntimeError(
            f"ValidationSchedule relies on a private hook of Lightning {lo[0]}.{lo[1]}.."
            f"{hi[0]}.{hi[1]}; this is Lightning {version}"
            + (f" without {', '.join(missing)}" if missing else "")
            + ": install a checked version (see pyproject.toml) or update ae/training/"
            "val_schedule.py"
        )


class ValidationSchedule(L.Callback):
    def __init__(self, every_n_steps: int) -> None:
        self.every = every_n_steps

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        loop = trainer.fit_loop.epoch_loop
        check_lightning(L.__version__, loop)
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
