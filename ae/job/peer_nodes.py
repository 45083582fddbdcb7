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

Staleness is measured on this host's monotonic clock, from the moment a file's content last
changed: the hosts' clocks need not agree (on NFS, close-to-open consistency makes each open
see the newest file that the writer renamed into place). A lost link, by contrast, leaves every
heartbeat fresh (the run folder is still shared): that job ends by `--pg_timeout`, and its
verdict is the network's.
"""

from __future__ import annotations

import socket
import time
from dataclasses import dataclass, field
from pathlib import Path

from ae.diagnose.heartbeats import read_heartbeat
from ae.log_lines import HEARTBEAT_FILE

NODE_LOST_S = 20.0  # four missed heartbeats (one every 5 s at most)
CHECK_S = 1.0


@dataclass
class PeerNodes:
    """The heartbeats of the ranks on other hosts; `check()` says when a host is lost."""

    logs: Path
    run_ts: str
    lost_after_s: float = NODE_LOST_S
    host: str = field(default_factory=socket.gethostname)
    _beats: dict[int, tuple[float, float]] = field(default_factory=dict)  # rank -> (time, seen)
    _hosts: dict[int, str] = field(default_factory=dict)
    _next_check: float = 0.0

    def check(self, now: float | None = None) -> str | None:
        """A sentence naming the lost host(s) and their ranks, or None while all beat."""
        now = time.monotonic() if now is None else now
        if now < self._next_check:
            return None
        self._next_check = now + CHECK_S
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
