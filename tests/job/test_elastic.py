"""The agreement of every node's torchrun agent on each attempt (`ae.job.elastic`), on a real
c10d TCPStore as the rendezvous round hands it out: group rank 0 judges the failed attempt from the
shared logs, every node takes the same run TS, attempt number and RESTART line, and an ending of
the stop rules ends every node with the same exit code and message."""

from __future__ import annotations

import threading
from datetime import timedelta
from pathlib import Path

import pytest
from torch.distributed import PrefixStore, TCPStore

from ae.job.elastic import Attempts, JobEnds, agree
from ae.job.restarts import SAME_FAILURE_EXIT
from ae.log_lines import RESTART
from tests.job.test_restarts import TS1, checkpoints, failed_attempt


def both_nodes(attempts: list[Attempts], round_: int) -> list[dict | JobEnds]:
    """One rendezvous round: node 1 waits for node 0's decision in the round's store."""
    master = TCPStore("127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=30))
    results: list[dict | JobEnds] = [{}, {}]

    def node(rank: int) -> None:  # each node its own connection, as each agent has
        client = TCPStore("127.0.0.1", master.port, timeout=timedelta(seconds=30))
        store = PrefixStore(f"round{round_}", client)
        try:
            results[rank] = agree(attempts[rank], store, rank, 2)
        except JobEnds as e:
            results[rank] = e

    threads = [threading.Thread(target=node, args=(r,)) for r in (1, 0)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    return results


@pytest.fixture
def job(tmp_path: Path) -> tuple[list[Attempts], Path]:
    logs, ckpts = tmp_path / "logs", checkpoints(tmp_path / "checkpoints", 4)
    return [Attempts(2, TS1, logs, ckpts) for _ in (0, 1)], logs


def test_every_node_takes_the_attempt_that_group_rank_0_decides(job) -> None:
    attempts, logs = job
    first = both_nodes(attempts, 0)
    assert first == [{"ts": TS1, "number": 0}] * 2
    failed_attempt(logs, TS1, 6)  # rank 1 failed at step 6; checkpoint at step 4
    second = both_nodes(attempts, 1)
    assert second[0] == second[1]
    decided = second[0]
    assert isinstance(decided, dict) and decided["number"] == 1 and decided["ts"] > TS1
    line = RESTART.parse(decided["line"])
    assert line is not None and (line["attempt"], line["max"]) == ("1", "2")
    assert (line["step"], line["resume"], line["redone"]) == ("6", "4", "2")
    assert decided["args"][0] == "--resume_from_checkpoint=last"
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
