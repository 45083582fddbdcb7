"""Where each training step's time goes on this rank: data wait, own compute, and sync.

Per training batch, three clocks (host time, `time.perf_counter`):
- data: the time spent in the train loader's `next()`, waiting for the batch (`fetched`, called
  by `ae.data.stream.resume.ResumableLoader`);
- sync: the time spent waiting for the other ranks. The gradient all-reduce is timed from the
  moment the last gradient is ready (`gradients_ready`, from DDP's comm hook as the last bucket
  is launched) to the end of backward (read as the optimizer step starts, a few us later), when
  DDP has waited for every bucket: the time backward only waits.
  Added to it is the stretch between the end of one batch and the fetch of the next:
  Lightning's per-step stop-signal broadcast (a collective, where a fast rank waits when its
  peer was slow after the all-reduce), the step boundary's work (`ae.training.step_boundary`:
  the EMA update, a checkpoint save, the stop vote, sampling), other bookkeeping;
- compute: the rest, from the batch in hand to the end of the optimizer step.
Own time = data + compute: what the rank would take alone. A fast rank waiting for a slow one
has a short own time and a long sync; the slow one the reverse.

The training loop calls `fetched`/`backward_done`/`batch_end` (`ae.forensics.loop_tracer`) and
the watchdog thread reads `window()` for the heartbeat: the records are appended and the epoch
sums swapped as whole tuples, so the readers need no lock. Validation and the start of an epoch
restart the clock (`restart`): they are not training steps.

Every clock is read on the thread that runs backward, never in a callback on the communication
library's threads: a Python callback there (a comm hook's `future.then`, as torch's own
`allreduce_hook` has) creates and deletes a Python thread state each time, and a DataLoader
that forks while that happens leaves a worker deadlocked at birth on Python 3.11 (its runtime
lock, held by the dying thread state, is copied locked). Found as a rare hang at the fork of the
validation workers.

On a GPU the all-reduce runs asynchronously on the device and these times are those of the
host; the split is exact on CPU (gloo), and on GPU the data wait is (the compute/sync split is not
validated there).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from typing import Any

from ae.stragglers import RECENT_S

# One batch: (end time, optimizer steps (0 or 1), data s, compute s, sync s)
Record = tuple[float, int, float, float, float]


class StepTimes:
    def __init__(self, recent_s: float = RECENT_S) -> None:
        self.recent_s = recent_s
        self._records: deque[Record] = deque()
        self.epoch: tuple[int, float, float, float] = (0, 0.0, 0.0, 0.0)  # steps, data, comp, sync
        self.last: Record | None = None  # the last batch's
        # Since the rank started (every epoch of this run): optimizer steps and data wait, s.
        # `ae-diagnose --goodput` reads it from each attempt's last heartbeat.
        self.run: tuple[int, float] = (0, 0.0)
        self._end: float | None = None  # end of the previous batch; None: restart at next fetch
        self._fetched_at: float | None = None
        self._data = 0.0
        self._collectives: list[tuple[float, float]] = []
        self.last_grad_ready: float | None = None  # this backward's last gradient, if DDP
        # The train loader's workers, for the heartbeat (`configure`).
        self.data_workers: Callable[[], list[dict[str, Any]]] | None = None

    def configure(self, recent_s: float, data_workers: Callable[[], list[dict[str, Any]]]) -> None:
        """A training rank's settings, set once by the rank (`ae.rank.train`): the recent
        window's length (`--straggler_window`) and its train loader's workers."""
        self.recent_s = recent_s
        self.data_workers = data_workers

    def restart(self) -> None:
        """The next batch's clock starts at its fetch (after validation, at an epoch start)."""
        self._end = None
        self._data = 0.0

    def new_epoch(self) -> None:
        self.epoch = (0, 0.0, 0.0, 0.0)
        self.restart()

    def fetched(self, started: float, done: float) -> None:
        """The train loader handed out a batch, asked for at `started`."""
        if self._end is None:
            self._end = started
        self._data += done - started
        self._fetched_at = done

    def collective(self, launched: float, done: float) -> None:
        """A wait for the other ranks' gradients, from `launched` to `done`."""
        self._collectives.append((launched, done))

    def backward_done(self, now: float) -> None:
        """Backward of an optimizer step's batch returned by `now` (DDP has waited for every
        bucket's all-reduce)."""
        if self.last_grad_ready is not None:
            self.collective(self.last_grad_ready, now)
            self.last_grad_ready = None

    def batch_end(self, now: float, steps: int) -> Record | None:
        """Close the batch that ends `now`; `steps`: optimizer steps it made (0 while
        accumulating)."""
        start, fetched = self._end, self._fetched_at
        self._end = now
        data, self._data = self._data, 0.0
        collectives, self._collectives = self._collectives, []
        if start is None or fetched is None:
            return None
        wait = 0.0
        if collectives:
            wait = max(0.0, max(d for _, d in collectives) - max(s for s, _ in collectives))
        compute = max(0.0, now - fetched - wait)
        sync = max(0.0, now - start - data - compute)
        record = (now, steps, data, compute, sync)
        self.last = record
        records = self._records
        records.append(record)
        while records[0][0] <= now - self.recent_s:
            records.popleft()
        n, d, c, s = self.epoch
        self.epoch = (n + steps, d + data, c + compute, s + sync)
        self.run = (self.run[0] + steps, self.run[1] + data)
        return record

    def window(self, now: float | None = None) -> dict[str, float] | None:
        """The recent window per optimizer step (HEARTBEAT `timing.recent`), or None without a
        step in it."""
        now = time.perf_counter() if now is None else now
        records = [r for r in tuple(self._records) if r[0] > now - self.recent_s]
        steps = sum(r[1] for r in records)
        if not steps:
            return None
        return per_step(self.recent_s, steps, *(sum(r[i] for r in records) for i in (2, 3, 4)))

    def epoch_window(self) -> dict[str, float] | None:
        steps, data, compute, sync = self.epoch
        return per_step(0.0, steps, data, compute, sync) if steps else None

    def heartbeat(self) -> dict[str, Any]:
        """HEARTBEAT `timing` and `data_workers`."""
        workers = self.data_workers() if self.data_workers is not None else []
        steps, data = self.run
        return {"timing": {"recent": self.window(), "epoch": self.epoch_window(),
                           "run": {"steps": steps, "data_s": round(data, 3)}},
                "data_workers": workers}  # fmt: skip


def per_step(
    window_s: float, steps: int, data: float, compute: float, sync: float
) -> dict[str, float]:
    """Sums over `steps` optimizer steps (seconds) -> the ms-per-step figures of a Window."""
    ms = 1000 / steps
    return {
        "window_s": window_s,
        "steps": steps,
        "step_ms": round((data + compute + sync) * ms, 3),
        "own_ms": round((data + compute) * ms, 3),
        "data_ms": round(data * ms, 3),
        "compute_ms": round(compute * ms, 3),
        "sync_ms": round(sync * ms, 3),
    }


step_times = StepTimes()


def gradients_ready() -> None:
    """A gradient bucket is ready and its all-reduce starts now: called by ae's DDP comm hook
    (`ae.training.nonfinite`), on the thread that runs backward. DDP launches the buckets in
    order, so the last call of a backward is when its last gradient was ready."""
    step_times.last_grad_ready = time.perf_counter()
