"""Ranks on several hosts (synthetic logs, bench/synthetic_logs.py): clocks that differ (each
rank's CLOCK_OFFSET line puts its times on rank 0's clock), and a host that dies."""

from __future__ import annotations

import socket
import subprocess
from pathlib import Path

import pytest

from ae.diagnose.log_files import find_run
from ae.diagnose.report import diagnose
from ae.log_lines import CLOCK_OFFSET
from bench.synthetic_logs import RankWriter, write_heartbeat, write_train_log

PEER = "NCCL error: remote process exited"
FRAMES = [("/x/train_ae.py", "main"), ("/x/torch/autograd/graph.py", "_engine_run_backward")]


@pytest.mark.parametrize("recorded", [True, False])
def test_the_first_failure_is_found_on_rank_0s_clock(tmp_path: Path, recorded: bool) -> None:
    """Rank 0 (node0) fails first, rank 1 (node1) two seconds later; node1's clock runs 5 s
    behind, so its log says it failed 3 s before rank 0. With the offset recorded, rank 0 is the
    first to fail; without it, the order (wrongly) blames rank 1."""
    write_train_log(tmp_path, 2)
    w0, w1 = RankWriter(tmp_path, 0, 2), RankWriter(tmp_path, 1, 2)
    w0.start(host="node0")
    w1.start(host="node1")
    w0.log(CLOCK_OFFSET.format(offset="+0.000", host="node0", error="0.000"))
    if recorded:
        w1.log(CLOCK_OFFSET.format(offset="-5.000", host="node1", error="0.002"))
    for w in (w0, w1):
        w.steps(1, 3)
    w0.fatal("DistBackendError", PEER, FRAMES)
    w1.t = w0.t + 2 - 5  # two seconds later, on a clock 5 s behind
    w1.fatal("DistBackendError", PEER, FRAMES)
    write_heartbeat(tmp_path, 1, 2, pid=1, t=w1.t, phase="training step", step=3, host="node1")
    for w in (w0, w1):
        w.flush()
    doc = diagnose(find_run(tmp_path))
    first = 0 if recorded else 1
    assert [(c["rank"], c["cause"]) for c in doc["culprits"]] == [
        (first, "exception: DistBackendError")
    ]
    assert "first rank to fail" in doc["culprits"][0]["rule"]


def test_a_host_that_went_silent_before_a_dead_local_rank_is_the_culprit(tmp_path: Path) -> None:
    """node1 lost power at t+3 (its rank's last heartbeat); 20 s later this host's launcher
    killed rank 0, blocked since in the all-reduce (its heartbeat went on until then). Both logs
    stop at the same step: the heartbeats say who went first."""
    write_train_log(tmp_path, 2)
    w0, w1 = RankWriter(tmp_path, 0, 2), RankWriter(tmp_path, 1, 2)
    w0.start(host=socket.gethostname())
    w1.start(host="node1")
    for w in (w0, w1):
        w.steps(1, 10)
        w.flush()
    gone = subprocess.Popen(["true"])
    gone.wait()
    write_heartbeat(tmp_path, 0, 2, pid=gone.pid, t=w0.t + 25, phase="training step", step=10,
                    last_progress=w0.t)  # fmt: skip
    write_heartbeat(tmp_path, 1, 2, pid=1, t=w1.t + 1, phase="training step", step=10,
                    host="node1")  # fmt: skip
    doc = diagnose(find_run(tmp_path))
    assert [(c["rank"], c["host"], c["cause"]) for c in doc["culprits"]] == [
        (1, "node1", "killed without trace")
    ]
    assert [(v["rank"], v["cause"]) for v in doc["victims"]] == [(0, "stopped after rank 1 died")]
