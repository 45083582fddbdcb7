"""Fault injection for tests and for building broken runs on purpose: off unless AE_FAULT is set.

Syntax (several faults separated by `,`)::

    AE_FAULT="<action>@<point>[:key=value]..."

actions:
  sleep   block in `_injected_sleep` for `secs` seconds (default 3600): a hang
  raise   raise `InjectedFault` from `_injected_raise`: an exception
  segv    SIGSEGV to the process itself from `_injected_segv`: a native crash
  kill    SIGKILL to the process itself from `_injected_kill`: the OOM killer
  oom     raise `torch.cuda.OutOfMemoryError` from `_injected_oom` (exists in CPU builds too)
  gpusleep  launch a CUDA kernel that spins `secs` seconds (default 3600) from
          `_injected_gpusleep`, and return at once: a hung kernel. The host runs on until it next
          waits for the GPU (a `.item()`, a copy to the CPU, a full launch queue) and stalls
          there. Without CUDA, a host sleep (as `sleep`)
  grow    allocate and touch `mb` MB, held until the process ends, from `_injected_grow`:
          memory growth for the OOM killer (in a memory-limited cgroup)
  desync  an all-reduce of `size` zeros (default 3) that only this rank calls, from
          `_injected_desync`: a collective mismatch (the others never call it; with the size of
          the gradient bucket it pairs with their gradient all-reduce, and the job hangs later)
  slow    sleep `ms` milliseconds in `_injected_slow` at every call from `step` on (until
          `until`): a straggler -- per batch at `data`, per optimizer step at `train`
  nan     `train` only: the loss of the step turns NaN (`loss_poison`), on the rank named
  inf     `train` only: the loss of the step turns +Inf (`loss_poison`)
points (who calls `fault_point`):
  data        in the dataset iteration (the dataloader worker, or the rank with 0 workers),
              before the rank's batch `step` of the run (epoch * batches per epoch + batch);
              fires in the one process that produces that batch
  train       in `training_step`, at global step `step` (trainer.global_step: the optimizer
              steps done), so in optimizer step `step` + 1, the step its batch makes; a loss
              fault's FAULT line names that step too (`the loss of optimizer step N+1`)
  checkpoint  in a checkpoint write, after its bytes and before the rename (rank 0 writes)
  sampling    in reconstruction sampling, before each sampling batch
keys:
  rank=R   only on global rank R (default: every rank)
  step=N   data: at batch N exactly; other points: the first call with step >= N (default 0);
           slow: every call with step >= N
  secs=S   sleep duration (default 3600)
  ms=M     slow: milliseconds per call (required)
  until=N  slow: not from step N on (default: never stops)
  mb=M     grow: megabytes to allocate (required)
  size=K   desync: elements of the extra all-reduce (default 3)
  attempt=A  only in attempt A of a job that restarts (`--max_restarts`; the first is 0;
           default: every attempt), so a restarted job can get past a fault

Examples::

    AE_FAULT="sleep@data:rank=1:step=3:secs=60"      rank 1 hangs while loading batch 3
    AE_FAULT="raise@train:rank=1:step=2"             rank 1 raises at step 2 (in optimizer step 3)
    AE_FAULT="sleep@checkpoint:rank=0:secs=600"      rank 0 hangs in its first checkpoint save
    AE_FAULT="segv@train:rank=1:step=2,kill@train:rank=0:step=2"
    AE_FAULT="slow@data:rank=1:ms=50"                 rank 1's batches each take 50 ms longer
    AE_FAULT="slow@train:rank=1:ms=40:until=500"      rank 1 takes 40 ms longer at steps 0-499
    AE_FAULT="grow@data:rank=1:step=2:mb=4000"       rank 1's worker grows by 4 GB at batch 2
    AE_FAULT="desync@train:rank=1:step=3"            rank 1 alone all-reduces 3 numbers
    AE_FAULT="gpusleep@train:rank=0:step=5:secs=60"  rank 0's GPU runs one kernel for 60 s
    AE_FAULT="kill@train:rank=1:step=5:attempt=0"    rank 1 is killed once; the restart runs on
    AE_FAULT="nan@train:rank=1:step=20"              rank 1's loss of optimizer step 21 is
                                                     NaN (its NONFINITE line: step 21)

A NaN that comes from the data itself, not from a fault: `tests/support/shards.py`
(`nan_sample`) writes a shard sample whose array holds one.

Each fault but `slow` fires at most once per process. A `FAULT injected: ...` WARNING is logged
first (once), so the fault is placed in the logs. With AE_FAULT unset, `fault_point` is one
`None` check.
"""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass

from loguru import logger

from ae.errors import UserError
from ae.log_lines import FAULT_INJECTED

ACTIONS = (
    "sleep", "raise", "segv", "kill", "oom", "slow", "grow", "desync", "gpusleep", "nan", "inf",
)  # fmt: skip
# Actions on the loss of a training step (`loss_poison`), not at `fault_point`.
LOSS_ACTIONS = ("nan", "inf")
_VALUE = {"nan": "NaN", "inf": "+Inf"}  # what a loss action makes of the loss, in its FAULT line
KEYS = {
    "rank": int, "step": int, "secs": float, "ms": float, "until": int, "mb": float, "size": int,
    "attempt": int,
}  # fmt: skip
POINTS = ("data", "train", "checkpoint", "sampling")
# The attempt number of a job that restarts (`--max_restarts`), set by the launcher for its ranks.
ATTEMPT_ENV = "AE_ATTEMPT"


class InjectedFault(RuntimeError):
    """Raised by a `raise@...` fault."""


@dataclass(frozen=True)
class Fault:
    action: str
    point: str
    rank: int | None = None
    step: int = 0
    secs: float = 3600.0
    ms: float = 0.0
    until: int | None = None
    mb: float = 0.0
    size: int = 3
    attempt: int | None = None

    def __str__(self) -> str:
        return f"{self.action}@{self.point}"


class FaultSpecError(UserError):
    """A malformed AE_FAULT value."""


def parse_faults(spec: str) -> list[Fault]:
    """`sleep@data:rank=1:step=3:secs=60,raise@train` -> Faults; FaultSpecError names the bad
    part."""
    faults = []
    for item in filter(None, (s.strip() for s in spec.split(","))):
        head, *pairs = item.split(":")
        action, _, point = head.partition("@")
        if action not in ACTIONS or point not in POINTS:
            raise FaultSpecError(
                f"AE_FAULT: {item!r}: expected <{'|'.join(ACTIONS)}>@<{'|'.join(POINTS)}>"
            )
        kwargs: dict[str, float | int] = {}
        for pair in pairs:
            key, _, value = pair.partition("=")
            if key not in KEYS:
                raise FaultSpecError(f"AE_FAULT: {item!r}: unknown key {key!r} ({', '.join(KEYS)})")
            try:
                kwargs[key] = KEYS[key](value)
            except ValueError:
                raise FaultSpecError(f"AE_FAULT: {item!r}: {key} needs a number") from None
        if action == "slow" and not kwargs.get("ms", 0) > 0:
            raise FaultSpecError(f"AE_FAULT: {item!r}: slow needs ms=M (milliseconds, > 0)")
        if action == "grow" and not kwargs.get("mb", 0) > 0:
            raise FaultSpecError(f"AE_FAULT: {item!r}: grow needs mb=M (megabytes, > 0)")
        if action in LOSS_ACTIONS and point != "train":
            raise FaultSpecError(f"AE_FAULT: {item!r}: {action} acts on the loss: {action}@train")
        if action == "desync" and not kwargs.get("size", 3) > 0:
            raise FaultSpecError(f"AE_FAULT: {item!r}: desync needs size=K (elements, > 0)")
        faults.append(Fault(action, point, **kwargs))  # type: ignore[arg-type]
    return faults


_UNREAD: list[Fault] = []  # sentinel: AE_FAULT not read yet
_faults: list[Fault] | None = _UNREAD
_fired: set[int] = set()


def active_faults() -> list[Fault] | None:
    """The faults of AE_FAULT for this attempt, parsed on first use (None when unset);
    FaultSpecError when it is malformed. The launcher calls this first, so a bad value stops the
    run before any rank."""
    global _faults
    if _faults is _UNREAD:
        spec = os.environ.get("AE_FAULT")
        attempt = int(os.environ.get(ATTEMPT_ENV, 0))
        mine = [f for f in parse_faults(spec) if f.attempt in (None, attempt)] if spec else []
        _faults = mine or None
    return _faults


def fault_point(point: str, step: int) -> None:
    """A place where a fault may be injected; one `None` check when AE_FAULT is unset."""
    if _faults is None:
        return
    faults = active_faults()
    if faults is None:
        return
    rank = int(os.environ.get("RANK", 0))
    for i, fault in enumerate(faults):
        if fault.point != point or fault.rank not in (None, rank) or fault.action in LOSS_ACTIONS:
            continue
        if fault.action == "slow":
            if step >= fault.step and (fault.until is None or step < fault.until):
                if i not in _fired:  # logged once, acts every time
                    _fired.add(i)
                    logger.warning(FAULT_INJECTED.format(
                        action="slow", point=point, step=step, rank=rank, effect=""
                    ))  # fmt: skip
                _injected_slow(fault.ms / 1000)
            continue
        if i in _fired:
            continue
        if step == fault.step or (point != "data" and step > fault.step):
            _fired.add(i)
            logger.warning(FAULT_INJECTED.format(
                action=fault.action, point=point, step=step, rank=rank, effect=""
            ))  # fmt: skip
            _ACT[fault.action](getattr(fault, _ARG.get(fault.action, "secs")))


def loss_poison(step: int) -> float | None:
    """NaN or +Inf at the step of a `nan@train` / `inf@train` fault (once per process, on the rank
    named), to multiply the step's loss by -- the loss that backward gets and the one logged
    alike; None otherwise. One `None` check when AE_FAULT is unset."""
    if _faults is None:
        return None
    faults = active_faults()
    if faults is None:
        return None
    rank = int(os.environ.get("RANK", 0))
    for i, fault in enumerate(faults):
        if fault.action not in LOSS_ACTIONS or fault.rank not in (None, rank) or i in _fired:
            continue
        if step >= fault.step:
            _fired.add(i)
            # At global step `step` the batch makes optimizer step `step + 1`: the step that the
            # NONFINITE line, the SKIPPED line and train/loss name.
            effect = f": the loss of optimizer step {step + 1} turns {_VALUE[fault.action]}"
            logger.warning(FAULT_INJECTED.format(
                action=fault.action, point="train", step=step, rank=rank, effect=effect
            ))  # fmt: skip
            return float(fault.action)  # x nan is NaN; x inf is +Inf for a loss > 0
    return None


# Named functions, so a stack dump shows which fault is acting.
def _injected_sleep(secs: float) -> None:
    time.sleep(secs)


def _injected_slow(secs: float) -> None:
    time.sleep(secs)


def _injected_raise(secs: float) -> None:
    raise InjectedFault("raise fault injected by AE_FAULT")


def _injected_segv(secs: float) -> None:
    os.kill(os.getpid(), signal.SIGSEGV)


def _injected_kill(secs: float) -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def _injected_oom(secs: float) -> None:
    import torch  # only here: fault points sit in torch-free modules too

    raise torch.cuda.OutOfMemoryError("CUDA out of memory (oom fault injected by AE_FAULT)")


def _injected_desync(size: float) -> None:
    import torch  # only here, as in _injected_oom
    import torch.distributed as dist

    dist.all_reduce(torch.zeros(int(size)))  # the others never call this one


# Cycles of the short kernel that measures the GPU's clock before a `gpusleep` (~10 ms).
_CALIBRATION_CYCLES = 20_000_000


def _injected_gpusleep(secs: float) -> None:
    import torch  # only here, as in _injected_oom

    if not torch.cuda.is_available():
        time.sleep(secs)
        return
    # torch.cuda._sleep spins for a number of GPU clock cycles: the clock is measured first (one
    # wait for the GPU here, at the fault, before the kernel that hangs).
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(_CALIBRATION_CYCLES)
    end.record()
    end.synchronize()
    cycles_per_s = _CALIBRATION_CYCLES / (start.elapsed_time(end) / 1000)
    torch.cuda._sleep(int(cycles_per_s * secs))


_held: list[bytearray] = []  # what `grow` allocated: kept until the process ends


def _injected_grow(mb: float) -> None:
    # Repetition writes every byte: the pages are resident (a zeroed allocation would not be).
    _held.append(bytearray(b"\x01") * int(mb * 2**20))


# The argument each action takes from its Fault (the others take `secs`).
_ARG = {"grow": "mb", "desync": "size"}
_ACT = {
    "grow": _injected_grow,
    "desync": _injected_desync,
    "sleep": _injected_sleep,
    "raise": _injected_raise,
    "segv": _injected_segv,
    "kill": _injected_kill,
    "oom": _injected_oom,
    "gpusleep": _injected_gpusleep,
}
