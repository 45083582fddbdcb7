"""What ae's position tells Lightning: the batch progress of its fit loop, rewritten in the
checkpoint dict before Lightning restores its loops (`sync.PositionSync.on_load_checkpoint`).

Left to itself, Lightning decides from its own counters whether a checkpoint ended its epoch: a
checkpoint taken after batch 37 of a 37-batch epoch, resumed where the epoch has 75 batches
(another batch size, fewer ranks), reads to Lightning as "mid-epoch, batch 37 of 75", and trains
38 batches of the next epoch as if they were the rest of the old one. Here the counters say what
ae's position says.
"""

from __future__ import annotations

import copy
from typing import Any

from ae.training.position.arithmetic import EpochPosition

BATCH_PROGRESS = "epoch_loop.batch_progress"
EPOCH_PROGRESS = "epoch_progress"
EPOCH_LOOP_STATE = "epoch_loop.state_dict"  # holds `_batches_that_stepped`, the loggers' step
_COUNTERS = ("ready", "started", "processed", "completed")


def reconcile_fit_loop(fit_loop: dict[str, Any], position: EpochPosition) -> dict[str, Any]:
    """The fit loop's saved state with its progress where `position` puts it, in the two states
    Lightning resumes cleanly from:

    - the epoch before `position.epoch` ended: every epoch counter at `position.epoch` (Lightning
      then starts that epoch at batch 0, its epoch-start hooks called), no batch of it begun;
    - mid-epoch: `position.epoch` started and not processed, its batch counters at ae's count
      (a save at a batch's end has one batch not yet `completed`; one after validation has none:
      the distance is kept, the running totals move alike).

    Both are rewritten whatever the checkpoint held: Lightning's own counters after a resume
    that it treated as mid-epoch are off by one epoch (it skips the epoch-start counts).

    The loggers' step (`_batches_that_stepped`) is saved before the batch being saved at counts
    itself; Lightning adds that one on a resume unless the counters read "epoch ended". Where
    they are rewritten to read so, the one is added here, or every logged step after the resume
    is one behind the optimizer's and the train loss at the loggers' cadence never reaches them."""
    loop = copy.deepcopy(fit_loop)
    epoch = position.epoch
    batches = loop[BATCH_PROGRESS]
    if position.after_epoch_end:
        counts = dict.fromkeys(_COUNTERS, epoch)
        done = batches["total"]["processed"]
        if batches["total"]["completed"] != done and EPOCH_LOOP_STATE in loop:
            loop[EPOCH_LOOP_STATE]["_batches_that_stepped"] += 1
        batches["total"] = dict.fromkeys(_COUNTERS, done)
        batches["current"] = dict.fromkeys(_COUNTERS, 0)
    else:
        counts = {"ready": epoch + 1, "started": epoch + 1, "processed": epoch, "completed": epoch}
        shift = position.batch - batches["current"]["processed"]
        for counters in (batches["current"], batches["total"]):
            for name in _COUNTERS:
                counters[name] += shift
    batches["is_last_batch"] = False
    loop[EPOCH_PROGRESS] = {"total": dict(counts), "current": dict(counts)}
    return loop
