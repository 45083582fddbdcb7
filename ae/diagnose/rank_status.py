"""What one rank's log says of its state: finished, its own failure, its open stall, its phase.

The verdict's rules (`ae.diagnose.verdict_rules`) read each rank through these, and the report
shows `current_phase`.
"""

from __future__ import annotations

import re

from ae.diagnose.logscan import Evidence
from ae.diagnose.rank_log import RankLog, Stall
from ae.diagnose.tracebacks import Crash

_PEER_TYPES = {
    "DistBackendError", "DistNetworkError", "DistStoreError", "BrokenPipeError",
    "ConnectionResetError", "ConnectionAbortedError", "SignalException", "SIGTERMException",
}  # fmt: skip
_PEER_TEXT = re.compile(
    r"Connection (?:closed|reset) by peer|Broken pipe|gloo/transport|remote (?:worker|process)|"
    r"NCCL (?:error|communicator)|nccl(?:Remote|System)Error|ProcessGroupNCCL|"
    r"Watchdog caught collective operation timeout|Timed out waiting|Socket Timeout|"
    r"got signal: 15|SIGTERM|"
    # gloo's pair timeout; through a DDP comm hook's callback it comes without gloo's file path
    r"Application timeout caused pair closure"
)


# The rank's own dataloader worker SIGKILLed (the OOM killer's signal): the rank's failure, even
# when the chain began with the broken connection to that worker (the batch it was handing over:
# `ConnectionResetError ... by peer` from multiprocessing's resource sharer, not a rank's peer).
_OWN_WORKER_KILLED = re.compile(r"DataLoader worker \(pid \d+\) is killed by signal: Killed")


def is_peer_failure(crash: Crash) -> bool:
    """An exception (any of a chain) that reports a dead, stuck or stopping peer."""
    if crash.signal or _OWN_WORKER_KILLED.search(crash.message):
        return False
    return crash.kind in _PEER_TYPES or bool(
        _PEER_TEXT.search("\n".join([crash.message, *crash.chain]))
    )


def primary_crash(r: RankLog) -> Crash | None:
    """The rank's first crash of its own: not a peer's, and not after it got SIGTERM (torchrun
    stopping the job; its dataloader workers die of it too)."""
    stopped = r.sigterm.time if r.sigterm is not None else None
    return next(
        (c for c in r.crashes
         if not is_peer_failure(c) and (stopped is None or c.time < stopped)),
        None,
    )  # fmt: skip


def finished(r: RankLog) -> bool:
    if r.crashes:
        return False
    if r.exit_code is not None:
        return r.exit_code == 0
    return r.heartbeat is not None and r.heartbeat.state == "exited"


def open_stall(r: RankLog) -> Stall | None:
    """The rank's unresolved stall, unless it exited or failed of its own after it. A failure
    that only ends the stall (a peer's error, SIGTERM from torchrun) leaves it open: the stall
    is what happened."""
    s = r.open_stall
    if s is None or finished(r):
        return None
    c = primary_crash(r)
    ends = ([c.time] if c else []) + ([r.exit.time] if r.exit else [])
    return None if any(t >= s.time for t in ends) else s


def network_stall(r: RankLog) -> Stall | None:
    """The collective wait a dropped link left the rank in: its open stall, or one that ended
    without a step's progress in a peer failure (gloo's broadcast can return at its timeout as
    the link drops, and the next collective fails on the closed pair: `STALL RESOLVED`, then
    `Application timeout caused pair closure` in the same step)."""
    if (s := open_stall(r)) is not None:
        return s
    s = r.resolved_stall
    if s is None or not s.waiting or not r.crashes or primary_crash(r) is not None:
        return None
    if r.step is not None and r.step > s.step:
        return None  # a step went by after the wait: that stall was over
    return s if r.crashes[0].time >= s.time else None


def current_phase(r: RankLog) -> str:
    # Its fit returned (TRAINING_FINISHED): the markers before it name training phases it left.
    if finished(r) or (r.training_finished is not None and not r.crashes):
        return "teardown"
    if (s := open_stall(r)) is not None:
        return s.phase
    if r.crashes:
        return r.crashes[0].phase or r.log_phase or "setup"
    hb = r.heartbeat  # the newest of the heartbeat, the stop signal line, the log says where
    stop, at = r.stop_phase, r.sigterm.time if r.sigterm is not None else 0.0
    newer = ([hb.time] if hb is not None else []) + ([r.marker.time] if r.marker else [])
    if stop is not None and all(at >= t for t in newer):
        # The watchdog's `Stop signal ... in phase teardown` names the phase the rank was in;
        # the last marker only the phase it entered last (a teardown has no marker).
        return stop
    # A rank that left on an error of its own (a user error's exit 2) wrote its last heartbeat
    # on its way out, in `teardown`: where it failed is what its log says.
    left = r.exit_code not in (None, 0) and r.training_finished is None
    beat = None if hb is None or (left and hb.phase == "teardown") else hb.phase
    if beat is not None and hb is not None and (r.last_time is None or hb.time >= r.last_time):
        return beat
    return r.log_phase or beat or "setup"


def last_words(r: RankLog) -> list[Evidence]:
    """Its last line, and the stacks faulthandler dumped when its watchdog could not run."""
    return [e for e in (r.last.evidence if r.last else None, r.native_dump) if e is not None]
