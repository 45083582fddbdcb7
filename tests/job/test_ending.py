"""How an attempt ended, on a node other than the first (ae/job/ending.py): it says so on its
own console, and a failure of its own ranks is told to the other nodes, whose ranks wait for
them. From synthetic logs in the real line formats."""

from __future__ import annotations

import socket
from pathlib import Path

from ae.config import parse_config
from ae.job.ending import ending
from ae.job.peer_nodes import PeerNodes
from ae.job.supervise import Stops
from ae.job.topology import Topology
from ae.run_paths import RunDir
from bench.synthetic_logs import TS, RankWriter, write_train_log

HERE = socket.gethostname()  # the host of node 1, whose launcher runs this
NODE1 = Topology(nnodes=2, node_rank=1, master_addr="10.0.0.1", master_port="29500", job="j")
IMPORT_FAILED = "model: cannot import mymodels: ImportError: No module named 'fancy_layers'"


def setup_failed_on(logs: Path, failed_host: str, other_host: str) -> None:
    """Rank 1 (on `failed_host`) stops on a user error in its setup; rank 0 (on `other_host`)
    waits for it to set up the process group."""
    write_train_log(logs, 2)
    w0, w1 = RankWriter(logs, 0, 2), RankWriter(logs, 1, 2)
    w0.start(host=other_host)
    w1.start(host=failed_host)
    w1.log(IMPORT_FAILED, "ERROR")
    w1.exit(2, "ModelError")
    for w in (w0, w1):
        w.flush()


def test_a_node_whose_rank_failed_tells_the_others_and_reports_it(
    tmp_path: Path, said: list[str]
) -> None:
    """Was: node 1's rank failed before the process group was up; node 1's launcher said
    `Training failed (exit 1)` and nothing more, and node 0's rank waited for it until
    --pg_timeout (600 s). Now node 1 leaves the other nodes a note naming its rank and error,
    and its failure is reported here as on node 0 (the caller's `report_failure`)."""
    cfg = parse_config([f"--output_dir={tmp_path}"])
    setup_failed_on(cfg.run.dir.logs, failed_host=HERE, other_host="node0")
    assert ending(cfg, NODE1, TS, 1, Stops()) == 1  # the failure, for the caller to report
    assert not any("Training failed (exit 1)" in line for line in said)
    told = PeerNodes(cfg.run.dir.logs, TS, node=0).check(now=0.0)
    assert told == (
        f"Node 1 (host {HERE}) failed: rank 1 on {HERE}, phase setup: error exit: ModelError\n"
        f"    {IMPORT_FAILED}\nStopping this node's ranks"
    )
    assert PeerNodes(cfg.run.dir.logs, TS, node=1).check(now=0.0) is None  # its own: no news
    assert PeerNodes(cfg.run.dir.logs, "20261121_130000", node=0).check(now=0.0) is None


def test_a_node_whose_ranks_only_followed_another_failure_tells_nobody(
    tmp_path: Path,
) -> None:
    cfg = parse_config([f"--output_dir={tmp_path}"])
    setup_failed_on(cfg.run.dir.logs, failed_host="node0", other_host=HERE)
    assert ending(cfg, NODE1, TS, 1, Stops()) == 1
    assert not RunDir(tmp_path).failed(1).exists()


def test_another_node_says_its_job_is_done(tmp_path: Path, said: list[str]) -> None:
    """Was: node 1's console ended with nothing after its ranks finished."""
    cfg = parse_config([f"--output_dir={tmp_path}"])
    assert ending(cfg, NODE1, TS, 0, Stops()) is None
    assert said == [f"Done. Logs: {cfg.run.dir.logs}/ (run {TS})"]
