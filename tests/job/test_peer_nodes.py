"""The launcher's watch over the other nodes' heartbeats (ae/job/peer_nodes.py), on heartbeat
files written as the ranks write them; time passes through `check(now=...)`."""

from __future__ import annotations

from pathlib import Path

from ae.job.peer_nodes import NODE_LOST_S, PeerNodes
from bench.synthetic_logs import TS, write_heartbeat


def beat(logs: Path, rank: int, t: float, host: str, state: str = "running") -> None:
    write_heartbeat(logs, rank, 4, pid=100 + rank, t=t, phase="training step", step=5,
                    host=host, state=state)  # fmt: skip


def test_a_silent_host_is_lost_and_named_with_its_ranks(tmp_path: Path) -> None:
    peers = PeerNodes(tmp_path, TS, host="node0")
    for rank, host in enumerate(["node0", "node0", "node1", "node1"]):
        beat(tmp_path, rank, 1000.0, host)
    assert peers.check(now=0.0) is None
    # node1's ranks stop beating; node0's own (ranks 0, 1) are not this watch's business
    assert peers.check(now=NODE_LOST_S - 1) is None
    lost = peers.check(now=NODE_LOST_S + 0.5)
    assert lost is not None and "host node1: ranks 2, 3" in lost and "node0" not in lost


def test_a_beating_host_is_never_lost_whatever_its_clock_says(tmp_path: Path) -> None:
    """Only changes count, on this host's clock: a heartbeat time hours in the past (a skewed
    clock) that keeps changing is alive."""
    peers = PeerNodes(tmp_path, TS, host="node0")
    for i in range(10):
        beat(tmp_path, 1, -7200.0 + i, "node1")
        assert peers.check(now=i * NODE_LOST_S / 2) is None


def test_a_rank_that_ended_on_its_own_is_not_lost(tmp_path: Path) -> None:
    peers = PeerNodes(tmp_path, TS, host="node0")
    beat(tmp_path, 1, 1000.0, "node1")
    assert peers.check(now=0.0) is None
    beat(tmp_path, 1, 1001.0, "node1", state="exited")
    assert peers.check(now=NODE_LOST_S * 3) is None
