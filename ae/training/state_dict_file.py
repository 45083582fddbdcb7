"""A frozen network's weights file, read safely and checked key by key: the loader of LPIPS's
files (`ae.training.perceptual`) and of the FID Inception (`ae.training.inception`).

The file is read by the safe loader (`weights_only=True`: tensors only, no code from the file)
and every key the network needs is checked for presence, shape, a float dtype and finite values:
a wrong, truncated or foreign file is one `WeightsFileError` naming it, the flag that gave it and
what it should be, not a traceback from `load_state_dict` in every rank.
"""

from __future__ import annotations

import zipfile
from pathlib import Path
from typing import Any

import torch

from ae.errors import UserError


class WeightsFileError(UserError):
    """A weights file that is missing, unreadable or not what it should be."""


def _why(e: Exception) -> str:
    """torch.load's failure in a few words. The safe loader's message opens with advice to load
    with weights_only=False, which ae never does for a weights file (it would run code from
    it): its reason is the line after "WeightsUnpickler error:"."""
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    if any("WeightsUnpickler error:" in ln for ln in lines):
        at = next(i for i, ln in enumerate(lines) if "WeightsUnpickler error:" in ln)
        after = lines[at].split("WeightsUnpickler error:", 1)[1].strip()
        reason = after or (lines[at + 1] if at + 1 < len(lines) else "")
        return f"not a file of tensors alone: {_sentence(reason)}"
    return f"{type(e).__name__}: {_sentence(lines[0])}" if lines else type(e).__name__


def _sentence(text: str) -> str:
    """The first sentence: torch's messages go on with advice that does not apply here."""
    return text.split(". ", 1)[0].rstrip(".")


def read_state_dict(path: Path, what: str) -> dict[str, Any]:
    """A torch file of tensors, read safely; torchvision's VGG16 file is in torch's legacy
    (pre-zip) format, which cannot be memory-mapped: mapped when possible, so that a 528 MB file
    of which 59 MB are used is not read whole by every rank."""
    if not path.is_file():
        raise WeightsFileError(f"{what}: no such file: {path}")
    try:
        mmap = zipfile.is_zipfile(path)
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except Exception as e:  # torch raises many kinds for a truncated or foreign file
        raise WeightsFileError(
            f"{what}: {path} is not a readable torch weights file ({_why(e)}); "
            "a partial download? Fetch it again"
        ) from None
    if isinstance(state, dict) and isinstance(state.get("state_dict"), dict):
        state = state["state_dict"]  # a Lightning-style wrapper
    if not isinstance(state, dict):
        raise WeightsFileError(f"{what}: {path} holds a {type(state).__name__}, not a dict")
    return state


def checked(
    state: dict[str, Any],
    shapes: dict[str, tuple[int, ...]],
    path: Path,
    what: str,
    fix: str,
) -> dict[str, torch.Tensor]:
    """The tensors of `shapes` out of `state` as float32, or one error listing what is wrong:
    missing keys, wrong shapes, non-float or non-finite values. Other keys are ignored (the
    classifier of a full VGG16 or Inception file)."""
    problems = []
    out = {}
    for key, shape in shapes.items():
        t = state.get(key)
        if not torch.is_tensor(t):
            problems.append(f"{key} missing")
        elif tuple(t.shape) != shape:
            problems.append(f"{key} is {tuple(t.shape)}, expected {shape}")
        elif not t.is_floating_point():
            problems.append(f"{key} is {t.dtype}, expected a float tensor")
        elif not torch.isfinite(t).all():
            problems.append(f"{key} has non-finite values")
        else:
            out[key] = t.float()
    if problems:
        shown = "; ".join(problems[:4]) + (
            f"; and {len(problems) - 4} more" if len(problems) > 4 else ""
        )
        raise WeightsFileError(f"{what}: {path} is not {fix}: {shown}")
    return out
