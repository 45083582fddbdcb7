"""Reading a checkpoint never runs code from it: every load of an ae checkpoint (resume through
Lightning's checkpoint IO, `ae-encode`, the EMA weights in it) goes through `load`.

A checkpoint is a pickle, and unpickling runs whatever the file names. `load` unpickles with
`torch.load(weights_only=True)`: tensors, plain containers and scalars only. ae's own checkpoints
hold nothing else (the input spec is stored as a plain dict); those written before this rule
pickled the input spec, which is rebuilt from its fields by its class name alone (`_SAFE_NAMES`),
as torch's safe loader does with its own allow-list: no other code of the file runs. A file that
names any other global is refused with one message naming it and the file (`UntrustedCheckpoint`,
exit 2), before any of it runs. `trust=True` (`--trust_checkpoint`) loads it the old way, which
runs code from the file: only for files you made.

A damaged file (truncated by a full disk or a copy cut short: no complete zip archive) is named
as such by `read`, with the newest complete checkpoint beside it that loads (`DamagedCheckpoint`,
exit 2), instead of torch's `PytorchStreamReader failed reading zip archive`.
"""

from __future__ import annotations

import importlib
import os
import pickle
import re
import sys
import zipfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from ae.data.decoding.decode import InputSpec
from ae.errors import UserError

TRUST_FLAG = "--trust_checkpoint"

# Modules that pickled classes lived in before they moved, and where they live now.
MOVED_MODULES = {
    "ae.decode": "ae.data.decoding.decode",
    "ae.data.decode": "ae.data.decoding.decode",
}

# The ae classes older checkpoints pickled (the input spec, in hyper_parameters). Today's
# checkpoints store a plain dict instead (`spec_record`).
_PICKLED_CLASSES = (InputSpec,)

# "... Unsupported global: GLOBAL io.open was not an allowed global ..." (torch's message)
_TORCH_REFUSAL = re.compile(r"Unsupported global: GLOBAL (\S+)")


def _safe_names() -> list[tuple[type, str]]:
    """Each pickled class under every name it was pickled as: its module now, and the modules
    it moved from."""
    names = []
    for cls in _PICKLED_CLASSES:
        moved_from = [old for old, new in MOVED_MODULES.items() if new == cls.__module__]
        for module in (cls.__module__, *moved_from):
            names.append((cls, f"{module}.{cls.__qualname__}"))
    return names


class UntrustedCheckpoint(UserError):
    """A checkpoint whose unpickling would run code (a global that is no tensor, container or
    scalar): refused, nothing of it run."""

    def __init__(self, path: Path | str, names: list[str]) -> None:
        self.path, self.names = str(path), names
        super().__init__(
            f"{path}: refused: loading this checkpoint would run code named in it "
            f"({', '.join(names)}); ae loads checkpoints with torch.load(weights_only=True), which "
            f"accepts tensors, plain containers and numbers. If you made this file yourself, "
            f"{TRUST_FLAG} loads it anyway (it runs code from the file: only for files you made)"
        )


def spec_record(spec: InputSpec) -> dict[str, Any]:
    """The input spec as a checkpoint keeps it: a plain dict (`spec_from_record` reads it)."""
    return {"kind": spec.kind, "shape": tuple(spec.shape)}


def spec_from_record(record: Any) -> InputSpec | None:
    """The input spec a checkpoint's hyper_parameters recorded (a dict today, an InputSpec in
    older checkpoints), or None when it has none."""
    if isinstance(record, InputSpec):
        return record
    if isinstance(record, dict) and {"kind", "shape"} <= record.keys():
        return InputSpec(record["kind"], tuple(record["shape"]))
    return None


@contextmanager
def moved_modules_importable() -> Iterator[None]:
    """While a trusted checkpoint loads the old way, let the old module paths resolve to the new
    modules (the safe loader needs no import: it knows the classes by name)."""
    added = [old for old in MOVED_MODULES if old not in sys.modules]
    for old in added:
        sys.modules[old] = importlib.import_module(MOVED_MODULES[old])
    try:
        yield
    finally:
        for old in added:
            sys.modules.pop(old, None)


def unsafe_globals(path: Path | str) -> list[str]:
    """The globals the checkpoint names that the safe loader would refuse, read from its pickle
    without running it (empty for a safe file, or one that is no torch.save zip)."""
    try:
        with torch.serialization.safe_globals(_safe_names()):
            return sorted(torch.serialization.get_unsafe_globals_in_checkpoint(path))
    except (ValueError, RuntimeError, OSError, pickle.UnpicklingError):
        return []


def load(
    path: Path | str, *, trust: bool = False, map_location: Any = "cpu", mmap: bool = False
) -> Any:
    """The checkpoint at `path`, unpickled safely (`trust=False`) or the old way (`trust`);
    `mmap`: tensors mapped from the file, not read (a check of what the file holds). Raises
    UntrustedCheckpoint for a file that needs more than the safe loader accepts; any other
    problem (a missing or broken file) as torch raises it."""
    if trust:
        with moved_modules_importable():
            return torch.load(path, map_location=map_location, weights_only=False, mmap=mmap)
    try:
        with torch.serialization.safe_globals(_safe_names()):
            return torch.load(path, map_location=map_location, weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as e:
        names = unsafe_globals(path) or _TORCH_REFUSAL.findall(str(e))
        if not names:  # not a refusal: a file that is no pickle at all
            raise
        raise UntrustedCheckpoint(path, names) from None


class DamagedCheckpoint(UserError):
    """A checkpoint file that is no complete archive: named, with the newest one that loads."""

    def __init__(self, path: Path | str, problem: str, instead: Path | None) -> None:
        self.path, self.instead = str(path), instead
        hint = (
            f"the newest complete checkpoint beside it is {instead}: resume with "
            f"--resume_from_checkpoint={instead}"
            if instead is not None
            else "no complete checkpoint beside it loads"
        )
        super().__init__(f"{path}: the checkpoint file is damaged ({problem}); {hint}")


def _damage(path: Path) -> str | None:
    """What is wrong with the file as an archive (torch.save writes a zip, whose directory is at
    its end: a truncated file has none), or None. Reads the directory only, not the tensors."""
    try:
        with zipfile.ZipFile(path):
            return None
    except zipfile.BadZipFile:
        size = path.stat().st_size
        return f"truncated or not a checkpoint: no complete archive in its {size} bytes"
    except (OSError, EOFError) as e:
        return f"{type(e).__name__}: {e}"


def newest_complete(folder: Path, damaged: Path) -> Path | None:
    """The newest step checkpoint in `folder` (by step) that loads, other than `damaged` and any
    link to the same file (`last.ckpt` is a hard link to the newest step checkpoint)."""
    same = os.stat(damaged) if damaged.exists() else None
    candidates = sorted(folder.glob("step-*.ckpt"), reverse=True)  # zero-padded: by step
    for path in candidates:
        if same is not None and os.path.samestat(os.stat(path), same):
            continue
        if _damage(path) is not None:
            continue
        try:
            load(path)
        except (UserError, RuntimeError, OSError, pickle.UnpicklingError, EOFError):
            continue
        return path
    return None


def read(
    path: Path | str, *, trust: bool = False, map_location: Any = "cpu", mmap: bool = False
) -> Any:
    """`load`, with a damaged file named as such (`DamagedCheckpoint`) and a missing one as
    `FileNotFoundError`: what every reader of a checkpoint calls."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such checkpoint file")
    if (problem := _damage(path)) is not None:
        raise DamagedCheckpoint(path, problem, newest_complete(path.parent, path))
    return load(path, trust=trust, map_location=map_location, mmap=mmap)


class NotAnAeCheckpoint(UserError):
    """A file that is no checkpoint ae wrote (unreadable, or without its model and config)."""


def read_ae_checkpoint(path: Path | str, *, trust: bool = False, mmap: bool = False) -> dict:
    """`read`, and the file must be a checkpoint of an ae run (its `state_dict` and
    `ae_config`): one UserError (damaged, untrusted, not ae's) for every way it is not."""
    try:
        ckpt = read(path, trust=trust, mmap=mmap)
    except UserError:
        raise
    except Exception as e:  # a user file can be broken in many ways
        problem = f"not a readable checkpoint: {type(e).__name__}: {e}"
        raise NotAnAeCheckpoint(f"{path}: {problem}") from e
    if not isinstance(ckpt, dict) or "state_dict" not in ckpt or "ae_config" not in ckpt:
        problem = "not a checkpoint written by ae (no state_dict or ae_config)"
        raise NotAnAeCheckpoint(f"{path}: {problem}")
    return ckpt
