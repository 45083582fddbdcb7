"""Learning-rate scaling by world size and the warmup + decay schedule."""

from __future__ import annotations

import math
from typing import Literal


def scale_lr(base_lr: float, world_size: int, mode: Literal["linear", "sqrt", "none"]) -> float:
    """Data-parallel ranks multiply the global batch; scale the LR with it.

    `linear` (Goyal et al., SGD) multiplies by the world size; `sqrt` (better suited to Adam-type
    optimizers, whose update size is already normalized) by its square root."""
    factor = {"linear": world_size, "sqrt": math.sqrt(world_size), "none": 1.0}[mode]
    return base_lr * factor


def lr_factor(step: int, warmup_steps: int, total_steps: int, kind: str) -> float:
    """Multiplier of the effective LR at optimizer step `step` (0-based).

    Linear warmup from 1/warmup to 1 over `warmup_steps`, then cosine decay to 0 at
    `total_steps` (or constant)."""
    if warmup_steps > 0 and step < warmup_steps:
        return (step + 1) / warmup_steps
    if kind == "constant" or total_steps <= warmup_steps:
        return 1.0
    progress = min(1.0, (step - warmup_steps) / (total_steps - warmup_steps))
    return 0.5 * (1.0 + math.cos(math.pi * progress))
