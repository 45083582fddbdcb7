"""Writer: what this rank is doing right now, a phase and a step, updated by cheap beats (the
heartbeat and STALL lines carry it; `ae.diagnose.phases` reads it back).

Training code calls `progress.enter(phase)` when it moves to another phase and `progress.beat()`
when it makes progress (a batch fetched, a step done). The watchdog thread and the heartbeat file
read these fields; a beat takes no lock and makes no collective call (plain attribute stores
are atomic under the GIL), so it costs well under a microsecond.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from ae.log_lines import STOP_SIGNAL

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
    # Set by a stop-signal handler (plain stores: safe there), with where the rank was when it
    # came; `stop_line` hands the line out once (watchdog thread or step boundary).
    stop_signal: str | None = None
    stop_signal_at: float | None = None  # time.time()
    stop_phase: str = ""
    stop_step: int = 0
    _stop_said: bool = False
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

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

    def record_stop_signal(self, name: str) -> None:
        """From a signal handler: the first stop signal, and the phase and step it came in."""
        if self.stop_signal is None:
            self.stop_phase, self.stop_step = self.phase, self.step
            self.stop_signal_at = time.time()
            self.stop_signal = name

    def stop_line(self) -> str | None:
        """The STOP_SIGNAL line, the first time it is asked for after a stop signal (then
        None): the first of the watchdog and the step boundary to ask logs it."""
        with self._lock:
            if self.stop_signal is None or self._stop_said:
                return None
            self._stop_said = True
        name, phase, step = self.stop_signal, self.stop_phase, self.stop_step
        return STOP_SIGNAL.format(signal=name, phase=phase, step=step)

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
