"""The ranks' agreement at a step boundary -- stop (a stop signal reached some rank), save (the
`--checkpoint_minutes` clock of some rank is due) -- with no collective on the training process
group and no wait on the device.

A rank cannot act on its own: the stop save and the timed save are collective, so every rank
must take them at the same step. Asking at every step (one all-reduce on the training group,
whose answer the host waits for) is a device-to-host sync per step with NCCL: the CPU cannot
queue step k+1 while step k runs. Instead the ranks vote in a process group of their own, gloo
on the CPU (torchtitan and TorchFT keep control traffic off the training stream the same way):

- a vote is one all-reduce (MAX) of three numbers -- stop?, save due?, seconds per step -- that
  is started at a vote step and read one optimizer step later. By then every rank has been
  through the gradient all-reduce of that next step, so every rank had started the vote and
  its answer is there: reading it waits for nothing. Every rank reads it at the same step, so
  every rank acts at the same step;
- votes are about `VOTE_EVERY_S` apart: the answer carries the slowest rank's seconds per step,
  from which every rank counts the same number of steps to the next vote (one step, when a step
  takes longer than that).

From a stop signal to its save therefore takes at most the time to the next vote plus one step
to read it, then the save (docs/RUNS.md). The next vote is a number of steps away counted at the
pace of the steps before: when the steps turn F times slower at once, it comes F times later (a
5 ms step turning 600 ms held a Ctrl-C ~15 s with votes a second apart). Hence votes a quarter
second apart: a vote costs ~0.6 ms of the process's CPU (gloo's asynchronous all-reduce, measured:
docs/BENCHMARKS.md), four a second ~0.25% of a core, and a 30-fold slowdown still saves within
SLURM's 30 s grace. A rank that makes no
progress at all for 10 s leaves without a save (`ae.training.preemption`). One process has no
group: its own flags are the answer, at every step.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

VOTE_EVERY_S = 0.25  # seconds between two votes, about (see the module docstring for why)
MAX_STEPS_BETWEEN = 1000  # a vote at least this often, however fast the steps


@dataclass(frozen=True)
class Decision:
    """What every rank does at this step boundary."""

    stop: bool = False
    save: bool = False


NOTHING = Decision()


class StepVote:
    """`answer` then `cast` at every optimizer-step boundary (`ae.training.step_boundary`), on
    every rank, in that order: what the last vote decided, acted on, then the flags of now."""

    def __init__(self, every_s: float = VOTE_EVERY_S) -> None:
        self.every_s = every_s
        self.group: dist.ProcessGroup | None = None
        self._pending: tuple[dist.Work, torch.Tensor, int] | None = None  # (work, vote, step)
        self._next_vote = 0  # the first step boundary at or after which the next vote is cast
        self._last_vote: tuple[int, float] | None = None  # (step, time) of the last vote cast

    def start(self, world_size: int, timeout: timedelta) -> None:
        """Every rank, once the training process group exists (creating a group is collective).
        A group of its own on gloo, whatever the training backend."""
        if world_size > 1 and self.group is None and dist.is_initialized():
            self.group = dist.new_group(backend="gloo", timeout=timeout)
        self._pending, self._next_vote, self._last_vote = None, 0, None

    @property
    def voting(self) -> bool:
        return self.group is not None

    def answer(self, step: int, mine: Callable[[], Decision]) -> Decision:
        """What every rank does at optimizer step `step`: its own flags (`mine`) in one process;
        with peers, the answer of the vote cast at the previous step, or NOTHING."""
        if self.group is None:
            return mine()
        if self._pending is None:
            return NOTHING
        work, vote, voted_at = self._pending
        self._pending = None
        work.wait()  # done already: every peer cast it a step ago (see the module docstring)
        stop, save, step_s = vote.tolist()
        between = self.every_s / step_s if step_s > 0 else 1.0
        self._next_vote = voted_at + max(1, min(MAX_STEPS_BETWEEN, int(between)))
        return Decision(stop > 0, save > 0)

    def cast(self, step: int, mine: Callable[[], Decision]) -> bool:
        """This rank's flags (`mine`) at optimizer step `step` into a vote, when one is due here
        (with peers); True when it cast one."""
        if self.group is None or self._pending is not None or step < self._next_vote:
            return False
        now = time.perf_counter()
        step_s = 0.0
        if self._last_vote is not None and step > self._last_vote[0]:
            step_s = (now - self._last_vote[1]) / (step - self._last_vote[0])
        self._last_vote = (step, now)
        flags = mine()
        vote = torch.tensor([float(flags.stop), float(flags.save), step_s], dtype=torch.float64)
        work = dist.all_reduce(vote, op=dist.ReduceOp.MAX, group=self.group, async_op=True)
        assert work is not None  # async_op=True always returns the work
        self._pending = (work, vote, step)
        return True

    def finish(self) -> None:
        """Training ended on every rank at the same step: let the last vote complete, so
        nothing of ours is in flight when the process group is torn down."""
        if self._pending is not None:
            self._pending[0].wait()
            self._pending = None
