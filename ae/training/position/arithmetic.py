"""Where a resumed epoch stands, in Lightning's units: pure arithmetic over what the checkpoint
recorded and what the new plan gives (no torch, no Lightning), so that it can be checked over
thousands of cases (tests/training/position/test_arithmetic.py)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class EpochPosition:
    """Where training goes on: `batch` of the `length` batches of `epoch` (Lightning's count: a
    resumed epoch counts the batches before the resume), `samples` of the epoch already trained
    (all ranks). `after_epoch_end`: the checkpoint was taken after the last batch of the epoch
    before, and `epoch` starts now."""

    epoch: int
    batch: int
    length: int
    samples: int
    after_epoch_end: bool = False


def resumed_position(
    *, saved_epoch: int, resume_epoch: int, batches: int, length: int, samples: int
) -> EpochPosition:
    """The position a run resumes at. `saved_epoch`: the checkpoint's epoch; `resume_epoch`: the
    epoch the data resumes in (one more when the checkpoint ended its epoch); `batches`:
    Lightning's count of the batches of `resume_epoch` already done; `length`: that epoch's
    length under the new plan; `samples`: of it, already trained."""
    if resume_epoch > saved_epoch:
        return EpochPosition(resume_epoch, 0, length, 0, after_epoch_end=True)
    return EpochPosition(resume_epoch, batches, length, samples)
