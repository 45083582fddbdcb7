"""Reader: which phase (`ae.forensics.progress.PHASES`, the writer's) a rank was in, from its log.

The heartbeat and STALL lines name the phase directly. Without them there are two clues: the
last marker (`========== EPOCH 0 TRAINING START ==========`, `CHECKPOINT SAVE START` ...) and, for
a crash, the frames of its traceback or faulthandler dump.
"""

from __future__ import annotations

import functools
import importlib.util
from pathlib import Path

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

# Our own code, by module or package, tried before the libraries' frames. The file paths to look
# for in a traceback are derived from where these modules really are (`_module_paths`), so a
# module that moves either keeps its phase or fails the test that resolves this table.
MODULE_PHASES = (
    ("ae.training.checkpoint_files", "checkpoint save"),
    ("ae.training.checkpointing", "checkpoint save"),
    ("ae.training.sampling", "sampling"),
    ("ae.training.encoding", "encoding"),
    ("ae.data", "data loading"),
)
# (substring of `path:function`, phase) for the libraries' loops, after our own modules.
_LIBRARY_PHASES = (
    (":save_checkpoint", "checkpoint save"),
    (":validation_step", "validation"),
    ("evaluation_loop", "validation"),
    (":training_step", "training step"),
    ("backward", "training step"),
    (":optimizer_step", "training step"),
    ("torch/utils/data", "data loading"),
)


def module_path(module: str) -> str:
    """`ae.data` -> `ae/data/`, `ae.training.sampling` -> `ae/training/sampling.py`: the path
    suffix of the module's source as found on disk (no module is imported, only its parent
    packages' `__init__`, which are empty)."""
    spec = importlib.util.find_spec(module)
    if spec is None or spec.origin is None:
        raise ModuleNotFoundError(f"{module}: named in MODULE_PHASES but not found")
    path, depth = Path(spec.origin), module.count(".")
    if spec.submodule_search_locations is not None:  # a package: every file below it
        return path.parent.relative_to(path.parents[depth + 1]).as_posix() + "/"
    return path.relative_to(path.parents[depth]).as_posix()


@functools.cache
def _frame_phases() -> tuple[tuple[str, str], ...]:
    own = tuple((module_path(m), phase) for m, phase in MODULE_PHASES)
    return own + _LIBRARY_PHASES


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
        for needle, phase in _frame_phases():
            if needle in where:
                return phase
    return None
