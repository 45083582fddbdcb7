"""Learning-rate scaling by world size, the warmup + decay schedule, and the lines stating them."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

from ae.log_lines import EFFECTIVE_LR, LR_FROM_FLAGS, LR_RESCALED

ScaleMode = Literal["linear", "sqrt", "none"]


def lr_scale_factor(world_size: int, mode: ScaleMode) -> float:
    """Data-parallel ranks multiply the global batch; scale the LR with it.

    `linear` (Goyal et al., SGD) multiplies by the world size; `sqrt` (better suited to Adam-type
    optimizers, whose update size is already normalized) by its square root."""
    return {"linear": float(world_size), "sqrt": math.sqrt(world_size), "none": 1.0}[mode]


def scale_lr(base_lr: float, world_size: int, mode: ScaleMode) -> float:
    return base_lr * lr_scale_factor(world_size, mode)


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


@dataclass
class Schedule:
    """`lr_factor` as the scheduler's function. Its fields are plain data, which `LambdaLR`
    saves in every checkpoint and restores into the resumed run's schedule: a run resumed with
    other settings knows the length its schedule was planned for, and is re-planned to its own
    (`total_steps` set anew: from the step reached on, the LR is what a run planned for the new
    length has there, and it reaches the schedule's end at the run's last step)."""

    warmup_steps: int
    total_steps: int
    kind: str

    def __call__(self, step: int) -> float:
        return lr_factor(step, self.warmup_steps, self.total_steps, self.kind)


def steps_to_end(
    *, done: int, epoch_len: int, full_len: int, epoch: int, max_epochs: int, accumulation: int
) -> int:
    """Optimizer steps from batch `done` of epoch `epoch` (of `epoch_len` batches) to the end of
    epoch `max_epochs - 1`, whose epochs have `full_len` batches. An optimizer step ends every
    `accumulation`-th batch of an epoch and its last one (Lightning's rule)."""

    def steps(first: int, end: int) -> int:
        if first >= end:
            return 0
        return end // accumulation - first // accumulation + (end % accumulation != 0)

    rest = steps(done, epoch_len)
    return rest + max(0, max_epochs - epoch - 1) * steps(0, full_len)


def effective_lr_line(base_lr: float, world_size: int, mode: ScaleMode) -> str:
    """`Base LR: 0.0001, Effective LR (scaled by 2, linear): 0.0002`."""
    factor = lr_scale_factor(world_size, mode)
    return EFFECTIVE_LR.format(
        base=f"{base_lr:g}", factor=f"{factor:g}", mode=mode, lr=f"{base_lr * factor:g}"
    )


def rescale(optimizer: Any, scheduler: Any, targets: list[float]) -> tuple[float, float] | None:
    """On resume on another number of ranks: the checkpoint's optimizer and schedule carry the
    LR scaled for the ranks that saved it (`base_lrs`, each group's `initial_lr`); set them to
    `targets`, this run's, and the groups' LR to where the schedule stands at its step. Returns
    the first group's (old, new) base LR, or None when they are this run's already."""
    old = list(scheduler.base_lrs)
    if len(old) != len(targets) or all(
        math.isclose(a, b) for a, b in zip(old, targets, strict=True)
    ):
        return None
    scheduler.base_lrs = list(targets)
    for group, base in zip(optimizer.param_groups, targets, strict=True):
        group["initial_lr"] = base
    at_schedule_step(optimizer, scheduler)
    return old[0], targets[0]


def at_schedule_step(optimizer: Any, scheduler: Any) -> None:
    """Each group's LR where the schedule stands at its step, after its base LRs or its plan
    changed (a resume): the next optimizer step uses it, not the LR the checkpoint carried."""
    for group, base, factor in zip(
        optimizer.param_groups, scheduler.base_lrs, scheduler.lr_lambdas, strict=True
    ):
        group["lr"] = base * factor(scheduler.last_epoch)


def lr_rescaled_line(
    world_size: int, step: int, old: float, new: float, mode: ScaleMode, flags: Sequence[str] = ()
) -> str:
    """`LR re-scaled for 1 ranks at step 4: effective LR 0.00141421 -> 0.001 (...)`; with the LR
    `flags` that changed, `LR set from the new --learning_rate at step 4: ...`."""
    fields = dict(
        world=world_size, step=step, old=f"{old:.6g}", new=f"{new:.6g}",
        factor=f"{lr_scale_factor(world_size, mode):g}", mode=mode,
    )  # fmt: skip
    if flags:
        return LR_FROM_FLAGS.format(flags=", ".join(f"--{f}" for f in flags), **fields)
    return LR_RESCALED.format(**fields)


def schedule_line(warmup_steps: int, total_steps: int, kind: str) -> str:
    """How the LR moves over the run, with a warning when warmup eats the whole run."""
    text = f"LR schedule: linear warmup over {warmup_steps} steps, then {kind}"
    text += f" ({total_steps} optimizer steps in all)"
    if warmup_steps >= total_steps:
        text += "; warmup is as long as the run: the LR never reaches its peak"
    return text


def disc_start_note(disc_start: int, total_steps: int) -> str | None:
    """A note when the discriminator starts after the run's last step (the default
    `--disc_start` is 50,001, a short first run never reaches it); not a warning: a run extended
    later by a resume may mean it."""
    if disc_start <= total_steps:
        return None
    return (
        f"Discriminator: --disc_start={disc_start} is after this run's last step ({total_steps}): "
        f"it does not train in this run; a lower --disc_start starts it sooner"
    )


@dataclass
class DiscSchedule(Schedule):
    """The discriminator's group: 0 before `start` (`--disc_start`), then the generator's
    schedule. A `Schedule`, so that a resume's re-planning moves its end with the others'."""

    start: int = 0

    def __call__(self, step: int) -> float:
        return 0.0 if step < self.start else super().__call__(step)
