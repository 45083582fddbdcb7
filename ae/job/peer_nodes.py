"""A node that dies: each launcher of a multi-node job watches the other nodes' ranks through
their heartbeat files in the shared run folder.

A node whose processes are all killed, or that loses power, closes no connection: the ranks of
the other nodes wait in their collective until `--pg_timeout` (600 s by default). Every rank's
watchdog thread rewrites its heartbeat file every few seconds, even while its main thread is
blocked, so a heartbeat of another host that has not changed for NODE_LOST_S (while it said
`running`) means that rank is gone. The launcher then logs which ranks of which host are lost
and stops its own ranks: SIGTERM through torchrun, then SIGKILL a few seconds later, since a rank
blocked in a collective with the lost node can neither run its signal handler nor save; the
failure report that follows names the dead node's ranks.

A stop signal that reached only another node's ranks (that node's launcher killed, so its
torchrun stopped them; `scancel` of one node) stops every rank at the same step, with a
checkpoint (`ae.training.preemption`). But the torchrun of this node then waits in its exit
barrier for that node's torchrun, which left without one, for 300 s: once this host's ranks
have all ended after the PREEMPTED line, `stopped_elsewhere` says so, and the launcher stops its
torchrun (SIGTERM; SIGKILL 5 s later, for a torchrun inside the barrier's wait, where its handler
cannot run) and reports the stop.

Staleness is measured on this host's monotonic clock, from the moment a file's content last
changed: the hosts' clocks need not agree (on NFS, close-to-open consistency makes each open
see the newest file that the writer renamed into place). A lost link, by contrast, leaves every
heartbeat fresh (the run folder is still shared): that job ends by `--pg_timeout`, and its
verdict is the network's.
"""

from __future__ import annotations

import json
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path

from ae.diagnose.heartbeats import read_heartbeat
from ae.diagnose.launcher_log import join_timed_out
from ae.job.processes import JOIN_TIMEOUT_S
from ae.job.topology import Topology
from ae.log_lines import (
    DEBUG_LOG_FILE,
    HEARTBEAT_FILE,
    LAUNCHER_LOG_FILE,
    PREEMPTED,
    RECORD_PATTERN,
    TRAIN_LOG_FILE,
)
from ae.run_paths import RunDir

NODE_LOST_S = 20.0  # four missed heartbeats (one every 5 s at most)
CHECK_S = 1.0
# Past a loaded host's rank startup (imports: up to ~40 s seen), well before torchrun's join
# timeout (JOIN_TIMEOUT_S, static and elastic rendezvous alike), which it waits out without a word.
NOT_JOINED_NOTE_S = 60.0
START_EVERY_NODE = (
    "Start the launcher on every node, each with NNODES, its own NODE_RANK, and the same "
    "MASTER_ADDR and MASTER_PORT"
)


def never_joined(logs: Path, ts: str, topo: Topology) -> str | None:
    """A sentence when torchrun ended because not every node joined within JOIN_TIMEOUT_S (its
    own output, `launcher_<TS>.log`, says so), naming the nodes missing; else None."""
    launcher_log = logs / LAUNCHER_LOG_FILE.format(ts=ts)
    try:
        found = join_timed_out(launcher_log.read_text(errors="replace"))
    except OSError:
        return None
    if found is None:
        return None
    joined, nodes = found
    others = f"node {topo.nnodes - 1}" if topo.nnodes == 2 else f"nodes 1 to {topo.nnodes - 1}"
    if joined is not None and nodes is not None and topo.nnodes > 2:
        others = f"{nodes - joined} of {others}"
    addr = f"{topo.master_addr}:{topo.master_port or 29500}"
    return (
        f"No rank started: {others} never joined this job (torchrun waited {JOIN_TIMEOUT_S} s "
        f"for all {topo.nnodes} nodes at {addr}, then gave up). {START_EVERY_NODE}, and check "
        f"that each reaches {addr} (its console's Network line); then start the job again on "
        "every node"
    )


@dataclass
class PeerNodes:
    """The heartbeats of the ranks on other hosts; `check()` says when a host is lost."""

    logs: Path
    run_ts: str
    lost_after_s: float = NODE_LOST_S
    host: str = field(default_factory=socket.gethostname)
    _beats: dict[int, tuple[float, float]] = field(default_factory=dict)  # rank -> (time, seen)
    _hosts: dict[int, str] = field(default_factory=dict)
    # Under torchrun's elastic agent (`ae.job.elastic`): each restart runs under a run TS of its
    # own, and torchrun stops the ranks of every node (SIGTERM) to take in a node that joins.
    follow_restarts: bool = False
    _next_check: float = 0.0
    _next_stop_check: float = 0.0
    _next_refused_check: float = 0.0
    started: float = field(default_factory=time.monotonic)  # the launch (monotonic clock)
    _noted: bool = False
    node: int = 0  # this launcher's NODE_RANK (its own note is not news)

    def not_joined(self, nnodes: int, now: float | None = None) -> str | None:
        """Once, NOT_JOINED_NOTE_S after the launch: a sentence when no rank of the job has
        started yet (torchrun starts them only when every node has joined), else None."""
        now = time.monotonic() if now is None else now
        if self._noted or now - self.started < NOT_JOINED_NOTE_S:
            return None
        self._noted = True
        if any(self.logs.glob(DEBUG_LOG_FILE.format(rank="*", ts=self.run_ts))):
            return None
        return (
            f"No rank has started {now - self.started:.0f} s after the launch: torchrun waits "
            f"for all {nnodes} nodes to join ({JOIN_TIMEOUT_S} s at most). {START_EVERY_NODE}"
        )

    def refused(self) -> str | None:
        """A sentence when another node's launcher will not join this run: started otherwise than
        this one, or a user error of its own (`ae.job.same_job.tell_leader`'s note, which is
        removed)."""
        now = time.monotonic()
        if now < self._next_refused_check:
            return None
        self._next_refused_check = now + CHECK_S
        root = self.logs.parent
        for path in sorted(root.glob(RunDir(root).refused("*").name)):
            try:
                note = json.loads(path.read_text())
                if note["run_ts"] != self.run_ts:
                    continue
                message, node, host = note["message"], note["node"], note["host"]
            except (OSError, ValueError, KeyError, TypeError):
                continue
            path.unlink(missing_ok=True)
            return f"Node {node} (host {host}) will not join this job: {message}\nStopping here too"
        return None

    def failed(self) -> str | None:
        """A sentence when another node's ranks failed (its launcher's note,
        `ae.job.same_job.tell_leader`): this node's ranks, waiting for them in the process
        group's setup or a collective, would wait up to --pg_timeout."""
        root = self.logs.parent
        for path in sorted(root.glob(RunDir(root).failed("*").name)):
            try:
                note = json.loads(path.read_text())
                if note["run_ts"] != self.run_ts or note["node"] == self.node:
                    continue
                message, node, host = note["message"], note["node"], note["host"]
            except (OSError, ValueError, KeyError, TypeError):
                continue
            return f"Node {node} (host {host}) failed: {message}\nStopping this node's ranks"
        return None

    def check(self, now: float | None = None) -> str | None:
        """A sentence naming the lost host(s) and their ranks, or another node's failure (its
        note), or None while all beat."""
        now = time.monotonic() if now is None else now
        if now < self._next_check:
            return None
        self._next_check = now + CHECK_S
        if (failed := self.failed()) is not None:
            return failed
        pattern = HEARTBEAT_FILE.format(rank="*", ts=self.run_ts)
        for path in self.logs.glob(pattern):
            hb = read_heartbeat(path)
            if hb is None or hb.host == self.host:
                continue
            if hb.state != "running":  # ended on its own: nothing more to hear from it
                self._beats.pop(hb.rank, None)
                continue
            seen = self._beats.get(hb.rank)
            if seen is None or seen[0] != hb.time:
                self._beats[hb.rank] = (hb.time, now)
                self._hosts[hb.rank] = hb.host
        lost = sorted(r for r, (_, seen) in self._beats.items() if now - seen >= self.lost_after_s)
        if not lost:
            return None
        by_host: dict[str, list[int]] = {}
        for rank in lost:
            by_host.setdefault(self._hosts[rank], []).append(rank)
        named = "; ".join(
            f"host {h}: rank{'s' * (len(rs) > 1)} {', '.join(map(str, rs))}"
            for h, rs in by_host.items()
        )
        return (
            f"Node lost: no heartbeat for {self.lost_after_s:.0f} s from {named} (its processes "
            "died, or the host did); stopping this node's ranks"
        )

    def stopped_elsewhere(self, now: float | None = None) -> str | None:
        """A sentence naming the ranks of other hosts that got a stop signal and the checkpoint
        every rank saved, once this host's ranks have all ended after it; else None."""
        now = time.monotonic() if now is None else now
        if now < self._next_stop_check:
            return None
        self._next_stop_check = now + CHECK_S
        if self.follow_restarts:  # the attempt that runs now: the newest train log
            names = (TRAIN_LOG_FILE.regex.fullmatch(p.name) for p in self.logs.glob("train_*.log"))
            self.run_ts = max([self.run_ts, *(m["ts"] for m in names if m)])
        pattern = HEARTBEAT_FILE.format(rank="*", ts=self.run_ts)
        here = [
            hb
            for p in self.logs.glob(pattern)
            if (hb := read_heartbeat(p)) and hb.host == self.host
        ]
        if not here or any(hb.state == "running" and hb.alive is not False for hb in here):
            return None
        train_log = self.logs / TRAIN_LOG_FILE.format(ts=self.run_ts)
        text = train_log.read_text(errors="replace") if train_log.is_file() else ""
        saved: dict[str, str] | None = None
        signalled: dict[int, str] = {}  # rank -> the signal it got (not "peer": its peers did)
        for line in text.splitlines():
            if (rec := RECORD_PATTERN.match(line)) and (m := PREEMPTED.parse(rec["message"])):
                saved = m
                if m["signal"] != "peer":
                    signalled[int(rec["rank"])] = m["signal"]
        if self.follow_restarts and any(hb.rank in signalled for hb in here):
            return None  # every node's ranks stopped: torchrun taking in a node, not a stop
        for hb in here:  # a rank of this host that got it: this node's own stop
            signalled.pop(hb.rank, None)
        if saved is None or not signalled:
            return None
        hosts = {rank: self._hosts.get(rank, "another host") for rank in signalled}
        who = ", ".join(f"rank {r} on {hosts[r]} ({sig})" for r, sig in sorted(signalled.items()))
        return (
            f"Stopped on another node: {who} got a stop signal (its launcher stopped or killed?); "
            f"every rank saved step {saved['step']}: {saved['path']}"
        )
