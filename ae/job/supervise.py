"""The launcher's child (torchrun, or the one rank of a SLURM task) and the stop signals.

The child runs in a session of its own, so a Ctrl-C in the terminal (SIGINT to the foreground
process group) reaches the launcher alone, which passes it on once: torchrun then signals every
rank, and the ranks save a checkpoint at their next step (`ae.training.preemption`). SIGTERM
(`docker stop` signals only a container's first process; `scancel` signals every process of the
job) goes the same way. A second Ctrl-C stops everything at once (SIGKILL to the child and all
its descendants: the ranks run in sessions of their own, and their dataloader workers).

Signal handlers only record and forward (`os.kill`); what the user reads is logged from the wait
loop, never from a handler.
"""

from __future__ import annotations

import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from typing import Any

import psutil
from loguru import logger

POLL_S = 0.2
# After another node was lost: time for this node's ranks to log the SIGTERM, then SIGKILL.
LOST_GRACE_S = 5.0
KILL_WAIT_S = 5.0


@dataclass
class Stops:
    """What the launcher got while its child ran."""

    first: signal.Signals | None = None  # the stop signal passed on to the child
    forwarded: set[signal.Signals] = field(default_factory=set)
    ctrl_c: int = 0
    killed: bool = False  # a second Ctrl-C: everything SIGKILLed
    lost: str | None = None  # another node of the job was lost (`ae.job.peer_nodes`)


def kill_tree(proc: subprocess.Popen) -> None:
    """SIGKILL the child and every process below it (deepest first is not needed: SIGKILL), and
    wait until they are gone: the diagnosis that follows must find their pids dead."""
    try:
        family = [*psutil.Process(proc.pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        family = []
    for p in [*family, proc]:
        with suppress(psutil.NoSuchProcess, ProcessLookupError):
            p.kill()
    psutil.wait_procs(family, timeout=KILL_WAIT_S)


@contextmanager
def stop_signals(proc: subprocess.Popen) -> Iterator[Stops]:
    stops = Stops()

    def handler(signum: int, frame: Any) -> None:
        sig = signal.Signals(signum)
        if sig == signal.SIGINT:
            stops.ctrl_c += 1
        if stops.first is None:
            stops.first = sig
        if sig not in stops.forwarded and proc.poll() is None:
            stops.forwarded.add(sig)
            proc.send_signal(sig)

    previous = {s: signal.signal(s, handler) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield stops
    finally:
        for s, h in previous.items():
            signal.signal(s, h)


def wait(
    proc: subprocess.Popen, peers_lost: Callable[[], str | None] | None = None
) -> tuple[int, Stops]:
    """Wait for the child, passing stop signals on; returns its exit code and what came.
    `peers_lost` (multi-node runs) says when another node is gone: the child is then stopped
    with SIGTERM, as a failure rather than a stop the user asked for."""
    with stop_signals(proc) as stops:
        told, lost_at = False, 0.0
        while True:
            try:
                return proc.wait(timeout=POLL_S), stops
            except subprocess.TimeoutExpired:
                pass
            if peers_lost is not None and stops.lost is None and (lost := peers_lost()):
                stops.lost, lost_at = lost, time.monotonic()
                logger.error(lost)
                proc.send_signal(signal.SIGTERM)
            elif stops.lost and not stops.killed and time.monotonic() - lost_at > LOST_GRACE_S:
                # Blocked in a collective with the lost node (where signal handlers cannot run),
                # the ranks would wait for torchrun's SIGKILL; none can save without that node.
                stops.killed = True
                kill_tree(proc)
            if stops.ctrl_c >= 2 and not stops.killed:
                stops.killed = True
                kill_tree(proc)
            elif stops.first is not None and not told:
                told = True
                ctrl_c = stops.first == signal.SIGINT
                logger.warning(
                    f"{'Ctrl-C' if ctrl_c else stops.first.name}: every rank saves a checkpoint "
                    f"at its next step, then stops{' (Ctrl-C again to stop at once)' * ctrl_c}"
                )
