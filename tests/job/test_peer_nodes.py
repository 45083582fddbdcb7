"""The launcher's watch over the other nodes' heartbeats (ae/job/peer_nodes.py), on heartbeat
files written as the ranks write them; time passes through `check(now=...)`."""

from __future__ import annotations

from pathlib import Path

from ae.job.peer_nodes import NODE_LOST_S, NOT_JOINED_NOTE_S, PeerNodes
from ae.log_lines import DEBUG_LOG_FILE
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


def preempted_line(rank: int, signal: str) -> str:
    return (
        f"2026-11-21 12:00:05.000 | WARNING  | [Rank {rank}/4] PREEMPTED by {signal} at step 7: "
        f"checkpoint /run/checkpoints/last.ckpt saved; stopping (LR 0.001)"
    )


def test_a_stop_that_reached_another_node_is_said_once_this_hosts_ranks_ended(
    tmp_path: Path,
) -> None:
    """Node 1's ranks got SIGTERM (its launcher killed): every rank saved step 7. While this
    host's ranks run, nothing; once they ended, the sentence names node 1's ranks and the save."""
    peers = PeerNodes(tmp_path, TS, host="node0")
    for rank, host in enumerate(["node0", "node0", "node1", "node1"]):
        beat(tmp_path, rank, 1000.0, host)
    assert peers.check(now=0.0) is None
    lines = [preempted_line(0, "peer"), preempted_line(1, "peer"), preempted_line(2, "SIGTERM"),
             preempted_line(3, "SIGTERM")]  # fmt: skip
    (tmp_path / f"train_{TS}.log").write_text("\n".join(lines) + "\n")
    assert peers.stopped_elsewhere(now=1.0) is None  # this host's ranks still run
    for rank in (0, 1):
        beat(tmp_path, rank, 1001.0, "node0", state="exited")
    said = peers.stopped_elsewhere(now=3.0)
    assert said == (
        "Stopped on another node: rank 2 on node1 (SIGTERM), rank 3 on node1 (SIGTERM) got a "
        "stop signal (its launcher stopped or killed?); every rank saved step 7: "
        "/run/checkpoints/last.ckpt"
    )


def test_a_stop_of_this_nodes_own_ranks_or_no_save_is_not_another_nodes(tmp_path: Path) -> None:
    peers = PeerNodes(tmp_path, TS, host="node0")
    beat(tmp_path, 0, 1000.0, "node0", state="exited")
    beat(tmp_path, 1, 1000.0, "node1", state="exited")
    assert peers.stopped_elsewhere(now=0.0) is None  # no PREEMPTED line: ended another way
    lines = [preempted_line(0, "SIGTERM"), preempted_line(1, "peer")]
    (tmp_path / f"train_{TS}.log").write_text("\n".join(lines) + "\n")
    assert peers.stopped_elsewhere(now=5.0) is None  # this node's own rank got it


def test_under_the_elastic_agent_the_watch_follows_the_attempt_that_runs_now(
    tmp_path: Path,
) -> None:
    """torchrun's agent restarted the job as run TS2; there node1's launcher was killed (its
    ranks got SIGTERM, node0's saved as peers). The watch, started with the first attempt's TS,
    says the stop of TS2. A restart to take in a node that joined stops every node's ranks with
    SIGTERM: that is no stop of another node."""
    ts2 = "20261121_120100"
    (tmp_path / f"train_{TS}.log").write_text("")
    peers = PeerNodes(tmp_path, TS, host="node0", follow_restarts=True)
    write_heartbeat(tmp_path, 0, 2, pid=1, t=1000.0, phase="teardown", step=7, host="node0",
                    state="exited", ts=ts2)  # fmt: skip
    lines = [preempted_line(0, "peer"), preempted_line(1, "SIGTERM")]
    (tmp_path / f"train_{ts2}.log").write_text("\n".join(lines) + "\n")
    said = peers.stopped_elsewhere(now=1.0)
    assert said is not None and said.startswith("Stopped on another node: rank 1 on another host")
    assert peers.run_ts == ts2
    lines = [preempted_line(0, "SIGTERM"), preempted_line(1, "SIGTERM")]  # both agents stopped
    (tmp_path / f"train_{ts2}.log").write_text("\n".join(lines) + "\n")
    assert peers.stopped_elsewhere(now=5.0) is None


def test_nodes_that_never_joined_are_said_once(tmp_path: Path) -> None:
    """Was: node 0 started alone printed its banner, then nothing for 600 s (torchrun's join
    timeout). Now, a minute after the launch with no rank started: one line saying what waits."""
    peers = PeerNodes(tmp_path, TS, host="node0", started=0.0)
    assert peers.not_joined(2, now=NOT_JOINED_NOTE_S - 1) is None  # ranks may still be starting
    said = peers.not_joined(2, now=NOT_JOINED_NOTE_S + 1)
    assert said is not None and "torchrun waits for all 2 nodes to join" in said
    assert "NODE_RANK" in said and "MASTER_ADDR" in said
    assert peers.not_joined(2, now=NOT_JOINED_NOTE_S * 5) is None  # once


def test_a_job_whose_ranks_started_is_not_waiting(tmp_path: Path) -> None:
    peers = PeerNodes(tmp_path, TS, host="node0", started=0.0)
    (tmp_path / DEBUG_LOG_FILE.format(rank=0, ts=TS)).write_text("")
    assert peers.not_joined(2, now=NOT_JOINED_NOTE_S + 1) is None
