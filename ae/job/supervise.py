"""The launcher's child (torchrun, or the one rank of a SLURM task) and the stop signals.

The child runs in a session of its own, so a Ctrl-C in the terminal (SIGINT to the foreground
process group) reaches the launcher alone, which passes it on once: torchrun then signals every
rank, and the ranks save a checkpoint at their next step (`ae.training.preemption`). SIGTERM
(`docker stop` signals only a container's first process; `scancel` signals every process of the
job) goes the same way. A second Ctrl-C stops everything at once (SIGKILL to the child and all
its descendants: the ranks run in sessions of their own, and their dataloader workers).

SIGUSR1 (SLURM's `--signal=USR1@90`, `scancel --signal=USR1`) asks for a save and a requeue: it
reaches the launcher, which passes SIGTERM on (the same save at the next step boundary; torchrun
would die of a USR1) and requeues the job once the ranks have saved (`ae.job.restarts`). The
child starts with USR1 ignored, inherited by torchrun, the ranks and their dataloader workers, so
a USR1 that SLURM sends to every process of the step ends none of them.

The launcher's handlers are in place before the child starts (`stop_signals`, then
`start_child`): a Ctrl-C in between is not a KeyboardInterrupt traceback of the launcher, and
the child starts with SIGINT and SIGTERM at their defaults, whatever the launcher inherited. A
launcher that a script started in the background (`./train_ae.sh ... &`, where the shell
ignores SIGINT) passed its ignored SIGINT on to its child, which lost a Ctrl-C passed on before
torchrun's own handlers were up: the job trained to its end, after the console had said that it
would save and stop.

Signal handlers only record and forward (`os.kill`); what the user reads is logged from the wait
loop, never from a handler. While the wait loop runs, a handler only records, and the loop passes
the signal on once it has said what the job does with it (within POLL_S): a rank the launcher
starts itself saves within milliseconds, and its own lines on the console came before the
launcher's announcement of them.
"""

from __future__ import annotations

import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext, suppress
from dataclasses import dataclass, field
from typing import Any

import psutil
from loguru import logger

from ae.forensics.progress import STUCK_AFTER_S

POLL_S = 0.2
# After another node was lost: time for this node's ranks to log the SIGTERM, then SIGKILL; after
# a stop that ended this node's ranks elsewhere: time for torchrun to end on its SIGTERM.
GRACE_S = 5.0
KILL_WAIT_S = 5.0
REQUEUE_SIGNAL = signal.SIGUSR1


@dataclass
class Stops:
    """What the launcher got while its child ran."""

    proc: subprocess.Popen | None = None  # the child the stops are passed on to, once started
    first: signal.Signals | None = None  # the stop signal passed on to the child
    forwarded: set[signal.Signals] = field(default_factory=set)
    ctrl_c: int = 0
    killed: bool = False  # a second Ctrl-C: everything SIGKILLed
    lost: str | None = None  # another node of the job was lost (`ae.job.peer_nodes`)
    requeue: bool = False  # REQUEUE_SIGNAL came: save, then requeue the job
    elsewhere: str | None = None  # the job saved and stopped on a stop signal to another node
    refused: str | None = None  # another node refused to join (started otherwise): a user error
    held: list[signal.Signals] | None = None  # while the wait loop runs: the signals to pass on

    def forward(self, sig: signal.Signals) -> None:
        """Pass `sig` on to the child, once, if it runs (a REQUEUE_SIGNAL as SIGTERM)."""
        passed = signal.SIGTERM if sig == REQUEUE_SIGNAL else sig
        if self.proc is not None and passed not in self.forwarded and self.proc.poll() is None:
            self.forwarded.add(passed)
            self.proc.send_signal(passed)


def start_child(
    cmd: list[str], env: dict[str, str], stops: Stops, keep_fds: tuple[int, ...] = ()
) -> subprocess.Popen | None:
    """The child in a session of its own, started inside `stop_signals` (`stops`): SIGINT and
    SIGTERM at their defaults in it (exec resets a handler, not an ignored signal), and
    REQUEUE_SIGNAL ignored in it and below it (an ignored signal stays ignored across exec);
    `keep_fds` stay open in it. None, and no child, when a stop signal came already."""
    if stops.first is not None:
        return None
    previous = signal.signal(REQUEUE_SIGNAL, signal.SIG_IGN)
    try:
        proc = subprocess.Popen(cmd, env=env, start_new_session=True, pass_fds=keep_fds)
    finally:
        signal.signal(REQUEUE_SIGNAL, previous)
    stops.proc = proc
    if stops.first is not None:  # came while it started
        stops.forward(stops.first)
    return proc


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
def stop_signals(proc: subprocess.Popen | None = None) -> Iterator[Stops]:
    """The launcher's stop signals recorded, and passed on to the child (`proc`, or the one
    `start_child` starts under them)."""
    stops = Stops(proc=proc)

    def handler(signum: int, frame: Any) -> None:
        sig = signal.Signals(signum)
        if sig == signal.SIGINT:
            stops.ctrl_c += 1
        if sig == REQUEUE_SIGNAL:
            stops.requeue = True
        if stops.first is None:
            stops.first = sig
        if stops.held is not None:
            stops.held.append(sig)  # the wait loop says it, then passes it on
        else:
            stops.forward(sig)

    signals = (signal.SIGINT, signal.SIGTERM, REQUEUE_SIGNAL)
    previous = {s: signal.signal(s, handler) for s in signals}
    try:
        yield stops
    finally:
        for s, h in previous.items():
            signal.signal(s, h)


def wait(
    proc: subprocess.Popen,
    peers_lost: Callable[[], str | None] | None = None,
    stopped_elsewhere: Callable[[], str | None] | None = None,
    note: Callable[[], str | None] | None = None,
    refused: Callable[[], str | None] | None = None,
    on_stop: str | None = None,
    stops: Stops | None = None,
) -> tuple[int, Stops]:
    """Wait for the child, passing stop signals on; returns its exit code and what came.
    `peers_lost` (multi-node runs) says when another node is gone: the child is then stopped
    with SIGTERM, as a failure rather than a stop the user asked for. `stopped_elsewhere` says
    when the job saved and stopped on another node's stop signal: torchrun, waiting for that
    node in its exit barrier, is stopped with SIGTERM. `note`: a warning to say when it returns
    one (the other nodes not joined yet), nothing done. `refused` says when another node will
    not join (started otherwise): the child, waiting for it, is killed (no rank has started).
    `on_stop`: what the ranks do on a stop signal, when not training's save (ae-encode's).
    `stops`: those of the `stop_signals` the child was started in, else its own."""
    with nullcontext(stops) if stops is not None else stop_signals(proc) as stops:
        told, lost_at, elsewhere_at = False, 0.0, 0.0
        stops.held = []  # the handlers leave passing a stop on to this loop
        while True:
            try:
                rc = proc.wait(timeout=POLL_S)
                stops.held = None  # from here on, a stop is passed on by its handler
                return rc, stops
            except subprocess.TimeoutExpired:
                pass
            if note is not None and (said := note()) is not None:
                logger.warning(said)
            if refused is not None and stops.refused is None and (said := refused()):
                stops.refused = said
                logger.error(said)
                kill_tree(proc)
            watch = stopped_elsewhere is not None and stops.first is stops.elsewhere is None
            if watch and (said := stopped_elsewhere()) is not None:  # type: ignore[misc]
                stops.elsewhere, elsewhere_at = said, time.monotonic()
                proc.send_signal(signal.SIGTERM)
            elif stops.elsewhere and not stops.killed and time.monotonic() - elsewhere_at > GRACE_S:
                # torchrun already in its exit barrier, a wait in C++ where its SIGTERM handler
                # cannot run, would wait out its 300 s for the node that left. Its ranks here
                # have all ended (what `stopped_elsewhere` waits for): nothing is lost.
                stops.killed = True
                kill_tree(proc)
            if peers_lost is not None and stops.lost is None and (lost := peers_lost()):
                stops.lost, lost_at = lost, time.monotonic()
                logger.error(lost)
                proc.send_signal(signal.SIGTERM)
            elif stops.lost and not stops.killed and time.monotonic() - lost_at > GRACE_S:
                # Blocked in a collective with the lost node (where signal handlers cannot run),
                # the ranks would wait for torchrun's SIGKILL; none can save without that node.
                stops.killed = True
                kill_tree(proc)
            if stops.ctrl_c >= 2 and not stops.killed:
                stops.killed = True
                kill_tree(proc)
            elif stops.first is not None and not told:
                told = True
                logger.warning(stop_said(stops.first, stops.requeue, on_stop))
            while stops.held:  # said first, now passed on
                stops.forward(stops.held.pop(0))


def stop_said(first: signal.Signals, requeue: bool, on_stop: str | None) -> str:
    """What the console says of the first stop signal: what the job does with it (`on_stop`:
    ae-encode's ranks save nothing)."""
    ctrl_c = first == signal.SIGINT
    then = ", then the job is requeued" if requeue else ""
    does = on_stop or (
        "every rank saves a checkpoint at its next step, then stops"
        f"{' (Ctrl-C again to stop at once)' * ctrl_c}"
    )
    # A hung job's ranks save nothing (README: Ctrl-C in a hang): say so up front.
    stuck = (
        ""
        if on_stop
        else f"; a rank stuck for {STUCK_AFTER_S:.0f} s or more leaves now, without one"
    )
    return f"{'Ctrl-C' if ctrl_c else first.name}: {does}{then}{stuck}"
