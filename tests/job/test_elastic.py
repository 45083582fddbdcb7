"""The agreement of every node's torchrun agent on each attempt (`ae.job.elastic`), on a real
c10d TCPStore as the rendezvous round hands it out: group rank 0 judges the failed attempt from the
shared logs, every node takes the same run TS, attempt number and RESTART line, and an ending of
the stop rules ends every node with the same exit code and message. A round without a node
(`--min_nodes`) says which was lost and the world before and after; and torchrun gets the
rendezvous `--min_nodes` asks for, refused where it cannot serve."""

from __future__ import annotations

import threading
from datetime import timedelta
from pathlib import Path

import pytest
from torch.distributed import PrefixStore, TCPStore

from ae.config import parse_config
from ae.job.elastic import Attempts, JobEnds, agent_args, agree, min_nodes_problems, nodes_changed
from ae.job.restarts import SAME_FAILURE_EXIT
from ae.job.topology import topology
from ae.log_lines import CHANGE_OF_NODES, NODES_CHANGED, RESTART
from bench.synthetic_logs import RankWriter
from tests.job.test_restarts import TS1, checkpoints, failed_attempt


def both_nodes(
    attempts: list[Attempts], round_: int, nodes: int = 2, failed: bool = True,
    hosts: tuple[str, ...] = ("node0", "node1"),
) -> list[dict | JobEnds]:  # fmt: skip
    """One rendezvous round of the first `nodes` agents (on `hosts`, one rank each), whose
    workers `failed` or not: group rank 1 waits for group rank 0's decision in the round's
    store."""
    master = TCPStore("127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=30))
    results: list[dict | JobEnds] = [{}] * nodes

    def node(rank: int) -> None:  # each node its own connection, as each agent has
        client = TCPStore("127.0.0.1", master.port, timeout=timedelta(seconds=30))
        store = PrefixStore(f"round{round_}", client)
        try:
            results[rank] = agree(attempts[rank], store, rank, nodes, nodes, hosts[rank], failed)
        except JobEnds as e:
            results[rank] = e

    threads = [threading.Thread(target=node, args=(r,)) for r in reversed(range(nodes))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    return results


@pytest.fixture
def job(tmp_path: Path) -> tuple[list[Attempts], Path]:
    logs, ckpts = tmp_path / "logs", checkpoints(tmp_path / "checkpoints", 4)
    return [Attempts(2, TS1, logs, ckpts, nnodes=2) for _ in (0, 1)], logs


def test_every_node_takes_the_attempt_that_group_rank_0_decides(job) -> None:
    attempts, logs = job
    first = both_nodes(attempts, 0)
    assert first == [{"ts": TS1, "number": 0, "hosts": ["node0", "node1"], "world": 2,
                      "args": ["--num_nodes=2"]}] * 2  # fmt: skip
    failed_attempt(logs, TS1, 6)  # rank 1 failed at step 6; checkpoint at step 4
    second = both_nodes(attempts, 1)
    assert second[0] == second[1]
    decided = second[0]
    assert isinstance(decided, dict) and decided["number"] == 1 and decided["ts"] > TS1
    line = RESTART.parse(decided["line"])
    assert line is not None and (line["attempt"], line["max"]) == ("1", "2")
    assert (line["step"], line["resume"], line["redone"]) == ("6", "4", "2")
    assert decided["args"][0] == "--resume_from_checkpoint=last"
    assert decided["args"][-1] == "--num_nodes=2" and line["nodes"] == ""  # the same nodes
    # node 1 holds the judged attempt too: it may be group rank 0 after a change of membership
    assert attempts[1].restarts.failed == attempts[0].restarts.failed
    assert [a.ts for a in attempts] == [decided["ts"]] * 2


def test_the_same_failure_twice_ends_every_node_with_exit_3(job) -> None:
    attempts, logs = job
    both_nodes(attempts, 0)
    failed_attempt(logs, TS1, 6)
    ts2 = both_nodes(attempts, 1)[0]["ts"]
    failed_attempt(logs, ts2, 6)  # the same cause at the same step
    ends = both_nodes(attempts, 2)
    assert all(isinstance(e, JobEnds) for e in ends), ends
    assert [e.code for e in ends] == [SAME_FAILURE_EXIT] * 2 == [3, 3]
    assert str(ends[0]) == str(ends[1]) and "the same failure at step 6 twice" in str(ends[0])


def test_a_round_without_node1_goes_on_with_node0_and_says_so(job) -> None:
    attempts, logs = job
    both_nodes(attempts, 0)
    failed_attempt(logs, TS1, 6)  # node1 is gone: only node 0 joins the next round
    decided = both_nodes(attempts, 1, nodes=1)[0]
    assert isinstance(decided, dict) and decided["hosts"] == ["node0"] and decided["world"] == 1
    line = RESTART.parse(decided["line"])
    assert (
        line is not None
        and line["nodes"] == "; node1 lost: going on with 1 of 2 nodes (world 2 -> 1)"
    )
    assert line["previous"] == TS1 and line["resume"] == "4"
    # the ranks resume from the checkpoint on one node
    assert decided["args"] == [
        "--resume_from_checkpoint=last",
        "--overwrite=false",
        "--num_nodes=1",
    ]


@pytest.mark.parametrize("newcomer_first", [False, True])
def test_a_node_that_comes_back_is_taken_in_without_counting_a_restart(
    job, newcomer_first: bool
) -> None:
    """node1 lost, then started again: a fresh agent, which knows no attempt, joins; the running
    agent's healthy workers are stopped (no failure). Whichever is group rank 0 decides alike."""
    attempts, logs = job
    both_nodes(attempts, 0)
    failed_attempt(logs, TS1, 6)
    alone = both_nodes(attempts, 1, nodes=1)[0]
    assert isinstance(alone, dict)
    stopped = RankWriter(logs, 0, 1, ts=alone["ts"])  # trained on alone, then stopped to take
    stopped.start(host="node0")  # node1 in
    stopped.steps(5, 9)
    stopped.flush()
    newcomer = Attempts(2, TS1, logs, attempts[0].restarts.checkpoints, nnodes=2)
    order = [newcomer, attempts[0]] if newcomer_first else [attempts[0], newcomer]
    hosts = ("node1", "node0") if newcomer_first else ("node0", "node1")
    decided = both_nodes(order, 2, failed=False, hosts=hosts)
    assert decided[0] == decided[1] and isinstance(decided[0], dict)
    line = RESTART.parse(decided[0]["line"])
    assert line is not None and line["failed"] == CHANGE_OF_NODES and line["step"] == "9"
    assert line["attempt"] == "1"  # still the one restart the failure used
    assert line["nodes"] == "; node1 joined: going on with 2 of 2 nodes (world 1 -> 2)"
    assert line["previous"] == alone["ts"] and decided[0]["number"] == 2
    assert decided[0]["args"][-1] == "--num_nodes=2"
    assert len(newcomer.restarts.failed) == 1 and newcomer.ts == decided[0]["ts"]


def test_nodes_changed_names_the_nodes_lost_and_joined() -> None:
    assert nodes_changed(["a", "b"], ["a", "b"], (4, 4), 2) == ""
    assert nodes_changed(["a", "b", "c"], ["a"], (6, 2), 3) == (
        "b, c lost: going on with 1 of 3 nodes (world 6 -> 2)"
    )
    back = NODES_CHANGED.parse(nodes_changed(["a"], ["a", "b"], (1, 2), 2))
    assert back is not None and (back["change"], back["before"], back["after"]) == (
        "b joined",
        "1",
        "2",
    )
    # two agents on one host: counted, not set-compared
    assert nodes_changed(["h", "h"], ["h"], (2, 1), 2).startswith("h lost: going on with 1 of 2")


def _layout(argv: list[str], nnodes: int = 2) -> tuple:
    cfg = parse_config(["--max_epochs=1", *argv])
    env = {"NNODES": str(nnodes), "NODE_RANK": "0", "MASTER_ADDR": "10.0.0.1"}
    return cfg.run, topology(cfg.run, env)


def test_min_nodes_becomes_torchruns_nnodes_range_with_the_rendezvous_timeouts() -> None:
    run, topo = _layout(["--max_restarts=1", "--min_nodes=1"])
    assert min_nodes_problems(run, topo) == []
    args = agent_args(run, topo, "29500", "10.0.0.1")
    assert "--nnodes=1:2" in args and "--max-restarts=2" in args
    conf = next(a for a in args if a.startswith("--rdzv-conf="))
    assert "is_host=1," in conf and "last_call_timeout=15" in conf and "join_timeout=600" in conf
    run, topo = _layout(["--max_restarts=1"])  # default: every node
    assert "--nnodes=2:2" in agent_args(run, topo, "29500", "10.0.0.1")


@pytest.mark.parametrize(
    ("argv", "nnodes", "said"),
    [(["--max_restarts=1", "--min_nodes=3"], 2, "between 1 and the job's 2 node(s); got 3"),
     (["--min_nodes=1"], 2, "without --max_restarts the job ends at its first failure"),
     (["--max_restarts=1", "--min_nodes=1"], 1, "this job runs on one node")],
)  # fmt: skip
def test_min_nodes_where_it_cannot_serve_is_refused(argv, nnodes, said) -> None:
    problems = min_nodes_problems(*_layout(argv, nnodes))
    assert len(problems) == 1 and problems[0].startswith("min_nodes: ") and said in problems[0]
