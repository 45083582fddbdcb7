"""The ranks' agreement at a step boundary -- stop (a stop signal reached some rank), save (the
`--checkpoint_minutes` clock of some rank is due) -- with no collective and no wait on the device.

A rank cannot act on its own: the stop save and the timed save are collective, so every rank
must take them at the same step. Asking at every step (one all-reduce on the training group,
whose answer the host waits for) is a device-to-host sync per step with NCCL: the CPU cannot
queue step k+1 while step k runs. Instead the ranks vote through the job's c10d store, the
key-value server that torchrun's agent (or rank 0) already runs for the process group: control
traffic off the training stream, as torchtitan and TorchFT keep it.

- A vote is a round: one counter in the store. At a vote step every rank adds one packed
  number to it (one `add`): 1 for itself, its stop and save flags, and on rank 0 the number of
  steps to the next vote. It reads the round one optimizer step later (one `add` of 0). By then
  every rank has been through the gradient all-reduce of that next step, so every rank had
  added its part: the count is whole and reading waits for nothing (when it is not whole, a
  rank whose CPU ran ahead of a peer, it polls until it is). Every rank reads the same number
  at the same step, so every rank acts at the same step.
- Votes are about `VOTE_EVERY_S` apart: rank 0 counts the steps to the next vote from its own
  seconds per step since the last one (the ranks step together), and every rank takes its count
  from the answer (one step, when a step takes longer than that).
- A round is deleted (by rank 0) once the next round is whole: every rank cast that next one
  after reading this one, so nobody reads it again. The store holds at most two rounds.

From a stop signal to its save therefore takes at most the time to the next vote plus one step
to read it, then the save (docs/RUNS.md). The next vote is a number of steps away counted at the
pace of the steps before: when the steps turn F times slower at once, it comes F times later (a
5 ms step turning 600 ms held a Ctrl-C ~15 s with votes a second apart). Hence votes a quarter
second apart: a vote is two round trips to the store (three on rank 0, which also deletes),
40-130 us of a rank's CPU, 3-10x less than the gloo all-reduce it replaced (docs/BENCHMARKS.md),
and a 30-fold slowdown still saves within SLURM's 30 s grace. A rank that makes no progress at
all for 10 s leaves without a save (`ae.training.preemption`). One process has no peers: its own
flags are the answer, at every step.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as dist

VOTE_EVERY_S = 0.25  # seconds between two votes, about (see the module docstring for why)
MAX_STEPS_BETWEEN = 1000  # a vote at least this often, however fast the steps
# A round's count: casts + stops * F + saves * F**2 + steps to the next vote * F**3 (F = _FIELD;
# each field below F: ranks, and MAX_STEPS_BETWEEN < F / 2, so the sum fits an int64)
_FIELD = 1 << 16
_POLL_S = (0.0005, 0.02)  # a round not yet whole is read again after this, doubling to that


@dataclass(frozen=True)
class Decision:
    """What every rank does at this step boundary."""

    stop: bool = False
    save: bool = False


NOTHING = Decision()


def job_store(timeout: timedelta) -> dist.Store:
    """A client of the job's c10d store, the one the training process group was made from
    (MASTER_ADDR:MASTER_PORT: torchrun's agent store, or rank 0's under SLURM and Lightning's
    own launch). A new store per restart, so a round's keys never meet an earlier attempt's."""
    host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    return dist.TCPStore(host, port, is_master=False, timeout=timeout)


class StepVote:
    """`answer` then `cast` at every optimizer-step boundary (`ae.training.step_boundary`), on
    every rank, in that order: what the last vote decided, acted on, then the flags of now."""

    def __init__(self, every_s: float = VOTE_EVERY_S) -> None:
        self.every_s = every_s
        self.store: dist.Store | None = None
        self._world, self._rank = 1, 0
        self._timeout = timedelta(minutes=30)
        self._runs = 0  # trainings started in this process: each votes under its own prefix
        self._round = 0  # the next round to cast
        self._pending: tuple[int, int] | None = None  # (round, step) cast and not yet read
        self._next_vote = 0  # the first step boundary at or after which the next vote is cast
        self._last_vote: tuple[int, float] | None = None  # (step, time) of the last vote cast

    def start(self, world_size: int, timeout: timedelta, store: dist.Store | None = None) -> None:
        """Every rank, once the training process group exists. `store`: the job's store unless
        given (a test's own)."""
        self._world, self._timeout = world_size, timeout
        self.store = None
        if world_size > 1 and dist.is_initialized():
            if world_size >= _FIELD:
                raise ValueError(f"the step vote counts up to {_FIELD - 1} ranks, not {world_size}")
            self._runs += 1
            self._rank = dist.get_rank()
            self.store = dist.PrefixStore(f"ae/vote/{self._runs}", store or job_store(timeout))
        self._round, self._pending, self._next_vote, self._last_vote = 0, None, 0, None

    @property
    def voting(self) -> bool:
        return self.store is not None

    def answer(self, step: int, mine: Callable[[], Decision]) -> Decision:
        """What every rank does at optimizer step `step`: its own flags (`mine`) in one process;
        with peers, the answer of the vote cast at the previous step, or NOTHING."""
        if self.store is None:
            return mine()
        if self._pending is None:
            return NOTHING
        voted, voted_at = self._pending
        self._pending = None
        count = self._read(self.store, voted, step)
        if voted > 0 and self._rank == 0:
            self.store.delete_key(f"{voted - 1}")  # every rank has read it (module docstring)
        self._next_vote = voted_at + max(1, count // _FIELD**3)
        return Decision(stop=count // _FIELD % _FIELD > 0, save=count // _FIELD**2 % _FIELD > 0)

    def _read(self, store: dist.Store, voted: int, step: int) -> int:
        """The round's count, once every rank cast it."""
        deadline, wait = time.monotonic() + self._timeout.total_seconds(), _POLL_S[0]
        while (count := store.add(f"{voted}", 0)) % _FIELD < self._world:
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"the step vote read at step {step}: {count % _FIELD} of {self._world} ranks "
                    f"cast it within {self._timeout} (a rank stopped before its step boundary)"
                )
            time.sleep(wait)
            wait = min(2 * wait, _POLL_S[1])
        return count

    def cast(self, step: int, mine: Callable[[], Decision]) -> bool:
        """This rank's flags (`mine`) at optimizer step `step` into a vote, when one is due here
        (with peers); True when it cast one."""
        if self.store is None or self._pending is not None or step < self._next_vote:
            return False
        now = time.perf_counter()
        between = 0  # rank 0's steps to the next vote; the other ranks add none
        if self._rank == 0 and self._last_vote is not None and step > self._last_vote[0]:
            step_s = (now - self._last_vote[1]) / (step - self._last_vote[0])
            between = min(MAX_STEPS_BETWEEN, int(self.every_s / step_s)) if step_s > 0 else 1
        self._last_vote = (step, now)
        flags = mine()
        part = 1 + flags.stop * _FIELD + flags.save * _FIELD**2 + between * _FIELD**3
        self.store.add(f"{self._round}", part)
        self._pending = (self._round, step)
        self._round += 1
        return True
