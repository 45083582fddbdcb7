"""What this rank is doing right now: a phase and a step, updated by cheap beats.

Training code calls `progress.enter(phase)` when it moves to another phase and `progress.beat()`
when it makes progress (a batch fetched, a step done). The watchdog thread and the heartbeat file
read these fields; nothing here takes a lock or makes a collective call (plain attribute stores
are atomic under the GIL), so a beat costs well under a microsecond.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

# The phases a rank can be in; `ae-diagnose` maps them to causes.
PHASES = (
    "setup",
    "shard planning",
    "data loading",
    "training step",
    "validation",
    "checkpoint save",
    "sampling",
    "encoding",  # ae-encode: a batch through the encoder, its latents into the output shard
    "teardown",
)
# A rank that has made no progress for this long after a stop signal will not reach the next
# step boundary, where the ranks save together: it is stuck (a hang, or waiting for a peer that
# died -- torchrun's SIGTERM after a peer failure). It leaves through the exception path instead
# (`ae.training.preemption`), so its `finally` blocks run and its log says why, rather than being
# SIGKILLed by torchrun 30 s later.
STUCK_AFTER_S = 10.0


@dataclass
class Progress:
    phase: str = "setup"
    epoch: int = 0
    step: int = 0
    last_beat: float = field(default_factory=time.monotonic)  # for idle time
    last_beat_wall: float = field(default_factory=time.time)  # for humans and heartbeat files
    # Set by a stop-signal handler (a plain store: safe there); the watchdog logs it.
    stop_signal: str | None = None
    stop_signal_at: float | None = None  # time.time()

    def beat(self, step: int | None = None, epoch: int | None = None) -> None:
        if step is not None:
            self.step = step
        if epoch is not None:
            self.epoch = epoch
        self.last_beat = time.monotonic()
        self.last_beat_wall = time.time()

    def enter(self, phase: str, step: int | None = None, epoch: int | None = None) -> None:
        assert phase in PHASES, phase
        self.phase = phase
        self.beat(step, epoch)

    def idle_s(self) -> float:
        return time.monotonic() - self.last_beat


progress = Progress()


@contextmanager
def in_phase(phase: str) -> Iterator[None]:
    """`with in_phase("checkpoint save"): ...` -- enter a phase, and return to the previous one."""
    previous = progress.phase
    progress.enter(phase)
    try:
        yield
    finally:
        progress.enter(previous)
