"""What ae's position tells Lightning: the batch progress of its fit loop, rewritten in the
checkpoint dict before Lightning restores its loops (`sync.PositionSync.on_load_checkpoint`).

Left to itself, Lightning decides from its own counters whether a checkpoint ended its epoch: a
checkpoint taken after batch 37 of a 37-batch epoch, resumed where the epoch has 75 batches
(another batch size, fewer ranks), reads to Lightning as "mid-epoch, batch 37 of 75", and trains
38 batches of the next epoch as if they were the rest of the old one. Here the counters say what
ae's position says: a checkpoint that ended its epoch stands at the last batch of the epoch under
the new plan (Lightning then starts the next epoch at batch 0, its own path for such a save), and
a mid-epoch one at ae's count of the epoch's batches.
"""

from __future__ import annotations

import copy
from typing import Any

from ae.training.position.arithmetic import EpochPosition

BATCH_PROGRESS = "epoch_loop.batch_progress"
_COUNTERS = ("ready", "started", "processed", "completed")


def reconcile_fit_loop(fit_loop: dict[str, Any], position: EpochPosition) -> dict[str, Any]:
    """The fit loop's saved state with its batch progress where `position` puts Lightning
    (`EpochPosition.lightning_batch`). The counters keep their distances (a save at a batch's
    end has one batch not yet `completed`; one after validation has none), which is how
    Lightning tells where in a batch the save was; the running totals move alike."""
    progress = copy.deepcopy(fit_loop[BATCH_PROGRESS])
    shift = position.lightning_batch - progress["current"]["processed"]
    for counters in (progress["current"], progress["total"]):
        for name in _COUNTERS:
            counters[name] += shift
    progress["is_last_batch"] = position.lightning_epoch_ended
    return {**fit_loop, BATCH_PROGRESS: progress}
