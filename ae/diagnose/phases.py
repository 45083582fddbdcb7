"""Which phase (ae.progress.PHASES) a rank was in, from what its log shows.

The heartbeat and STALL lines name the phase directly. Without them there are two clues: the
last marker (`========== EPOCH 0 TRAINING START ==========`, `CHECKPOINT SAVE START` ...) and, for
a crash, the frames of its traceback or faulthandler dump.
"""

from __future__ import annotations

from ae.log_lines import EPOCH_MARKER_NAME

# Marker name (without `EPOCH e `) -> the phase between its START and END.
_INSIDE = {
    "TRAINING": "training step",
    "VALIDATION": "validation",
    "CHECKPOINT SAVE": "checkpoint save",
    "SAMPLING": "sampling",
}
# After an END: TRAINING END comes before the epoch-end sync and validation; after any other
# END the loop goes back to training (the next batch is fetched first).
_AFTER = {"TRAINING": "validation"}

# (substring of `path:function`, phase), tried on each frame from the innermost out: the first
# frame that matches names the phase. Our own modules first, then the libraries' loops.
_FRAME_PHASES = (
    ("ae/checkpoint", "checkpoint save"),
    (":save_checkpoint", "checkpoint save"),
    ("ae/sampling", "sampling"),
    (":validation_step", "validation"),
    ("evaluation_loop", "validation"),
    (":training_step", "training step"),
    ("backward", "training step"),
    (":optimizer_step", "training step"),
    ("ae/dataset", "data loading"),
    ("ae/tar_", "data loading"),
    ("ae/decode", "data loading"),
    ("torch/utils/data", "data loading"),
)


def marker_stage(name: str) -> str:
    """`EPOCH 3 TRAINING` -> `TRAINING`; `CHECKPOINT SAVE` stays."""
    m = EPOCH_MARKER_NAME.fullmatch(name)
    return m["stage"] if m else name


def phase_after_marker(name: str, edge: str) -> str | None:
    stage = marker_stage(name)
    if stage not in _INSIDE:
        return None
    if edge == "START":
        return _INSIDE[stage]
    return _AFTER.get(stage, "training step")


def phase_of_frames(frames: list[tuple[str, str]]) -> str | None:
    """`frames`: (file path, function), innermost first."""
    for path, func in frames:
        where = f"{path.replace(chr(92), '/')}:{func}"
        for needle, phase in _FRAME_PHASES:
            if needle in where:
                return phase
    return None
