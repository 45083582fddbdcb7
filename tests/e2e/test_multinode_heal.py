"""Healing across nodes on two real hosts (network namespaces, bench/two_hosts.py): each
node's launcher starts torchrun's elastic agent (c10d rendezvous, `--max_restarts`), and a rank
SIGKILLed on host 1 (AE_FAULT `attempt=0`) restarts the job on both hosts from the newest
checkpoint (`ae.job.elastic`). One launch per scenario, several assertions on it."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from ae.data.shards.writer import write_shard
from ae.log_lines import GOODPUT, RESTART
from bench.two_hosts import TwoHosts
from tests.e2e.test_multinode import (
    _two_hosts_possible,
    console,
    diagnose_json,
    node_env,
    start_node,
)
from tests.support.log_span import log_span
from tests.support.runs import TWO_HOSTS
from tests.support.shards import vector_samples

pytestmark = [pytest.mark.slow, TWO_HOSTS]  # network namespaces, rendezvous and pg timeouts
__all__ = ["_two_hosts_possible"]  # the module's skip, where namespaces cannot be made

STEP_LOSS = re.compile(r"\] Training step (\d+), loss=(\S+?)[,\s]")


def two_node_run(tmp_path: Path, name: str, args: list[str], port: int,
                 fault: str | None = None) -> tuple[Path, list[int]]:  # fmt: skip
    out = tmp_path / name
    out.parent.mkdir(parents=True, exist_ok=True)
    with TwoHosts() as hosts:
        envs = [node_env(i, port, tmp_path) for i in (0, 1)]
        if fault is not None:
            envs[1]["AE_FAULT"] = fault  # only host 1's rank
        procs = [start_node(hosts, i, args, envs[i], out) for i in (0, 1)]
        codes = [p.wait(timeout=400) for p in procs]
    return out, codes


def losses(out: Path) -> dict[int, str]:
    """Rank 0's train loss at each step, the later attempts' winning."""
    found: dict[int, str] = {}
    for log in sorted((out / "logs").glob("debug_rank0_*.log")):
        found.update({int(s): loss for s, loss in STEP_LOSS.findall(log.read_text())})
    return found


def shards(out: Path, name: str, sizes: list[int]) -> str:
    start = 0
    for i, n in enumerate(sizes):
        write_shard(out / f"{name}-{i:06d}.tar", vector_samples(n, 16, start))
        start += n
    return str(out / f"{name}-{{000000..{len(sizes) - 1:06d}}}.tar")


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    tmp = tmp_path_factory.mktemp("heal")
    train = shards(tmp / "shards", "train", [40, 40, 40, 40])
    val = shards(tmp / "shards", "val", [16])
    args = [f"--train_shards={train}", f"--val_shards={val}", "--devices=1", "--batch_size=8",
            "--num_workers=0", "--max_epochs=-1", "--max_steps=12", "--checkpointing_period=4",
            "--debug=true", "--log_every_n_train_batches=1"]  # fmt: skip
    plain = two_node_run(tmp, "plain", args, 29631)
    healed = two_node_run(tmp, "healed", [*args, "--max_restarts=2"], 29633,
                          fault="kill@train:step=6:attempt=0")  # fmt: skip
    return {"plain": plain, "healed": healed}


def test_a_rank_killed_on_host_1_restarts_both_hosts_with_the_same_losses(runs) -> None:
    plain_out, plain_codes = runs["plain"]
    out, codes = runs["healed"]
    assert plain_codes == [0, 0], console(plain_out, 0) + console(plain_out, 1)
    assert codes == [0, 0], console(out, 0) + console(out, 1)
    expected = losses(plain_out)
    assert sorted(expected) == list(range(1, 13))
    got = losses(out)
    assert got == expected  # every step, the same loss: resumed exactly, ended at step 12
    for node in (0, 1):  # the RESTART line on every node's console, as the launcher's lines
        said = [t for t in console(out, node).splitlines() if "RESTART" in t]
        assert len(said) == 1 and re.match(r"\d\d:\d\d:\d\d RESTART ", said[0]), said
        lines = [m for t in said if (m := RESTART.parse(t[t.find("RESTART") :]))]
        assert len(lines) == 1, console(out, node)
        assert lines[0]["attempt"] == "1" and lines[0]["max"] == "2"
        assert "killed" in lines[0]["failed"] and lines[0]["resume"] == "4", lines[0]
    train_logs = sorted((out / "logs").glob("train_*.log"))
    assert len(train_logs) == 2  # each attempt its own run TS
    second = train_logs[1].read_text()
    assert any(RESTART.parse(t[t.find("RESTART") :]) for t in second.splitlines() if "RESTART" in t)
    assert "Training finished at step 12" in second


def test_what_the_restart_cost_adds_up_to_the_wall_time(runs) -> None:
    """`ae-diagnose --goodput` on the healed run: its parts add up to the wall time its logs
    span, within a second; the first node's console ends with the same figures."""
    out, _ = runs["healed"]
    found = diagnose_json(out / "logs")["goodput"]
    parts = found["parts"]
    assert found["attempts"] == 2 and parts["restart"] > 0 and parts["recompute"] > 0, found
    assert abs(sum(parts.values()) - found["wall_s"]) < 1.0, found
    assert abs(found["wall_s"] - log_span(out / "logs")) < 1.0, found
    said = [m for t in console(out, 0).splitlines() if (m := GOODPUT.parse(t))]
    assert len(said) == 1 and abs(float(said[0]["wall"]) - found["wall_s"]) < 0.1, said


@pytest.fixture(scope="module")
def repeating(tmp_path_factory) -> tuple[Path, list[int]]:
    """Host 1's rank killed at step 6 in every attempt: the same failure twice."""
    tmp = tmp_path_factory.mktemp("repeat")
    train = shards(tmp / "shards", "train", [40, 40, 40, 40])
    val = shards(tmp / "shards", "val", [16])
    args = [f"--train_shards={train}", f"--val_shards={val}", "--devices=1", "--batch_size=8",
            "--num_workers=0", "--max_epochs=-1", "--max_steps=12", "--checkpointing_period=4",
            "--debug=true", "--max_restarts=3"]  # fmt: skip
    return two_node_run(tmp, "repeat", args, 29635, fault="kill@train:step=6")


def test_a_failure_that_repeats_ends_both_hosts_with_exit_3(repeating) -> None:
    out, codes = repeating
    assert codes == [3, 3], console(out, 0) + console(out, 1)
    for node in (0, 1):  # one restart, then the same message on every node
        text = console(out, node)
        assert len([t for t in text.splitlines() if RESTART.parse(t[t.find("RESTART") :])]) == 1
        assert "not restarting: the same failure at step 6 twice" in text, text
    assert len(list((out / "logs").glob("train_*.log"))) == 2  # no third attempt started
