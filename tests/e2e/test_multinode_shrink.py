"""A job that loses a whole node goes on without it (`--min_nodes`, issue 38), on two real hosts
(network namespaces, bench/two_hosts.py): host 1's rank hangs at step 6 of the first
epoch and the test SIGKILLs every process of host 1 (launcher, torchrun, rank). Host 0's rank
fails in its collective, its torchrun agent re-forms the rendezvous without node1 once node1's
heartbeats have stopped, and host 0 trains the rest of the epoch alone from the step-4
checkpoint. One launch; the assertions share it.

The model records every sample it trains on (tests/support/key_recorder.py), as the resume
coverage tests do: the batches of the first attempt up to the checkpoint it resumed from, with
those of the second, hold every sample of the epoch exactly once. What the loss cost
(`ae-diagnose --goodput`) adds up to the wall time the logs span."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from ae.data.shards.writer import write_shard
from ae.job.elastic import LAST_CALL_S
from ae.log_lines import GOODPUT, LR_RESCALED, NODES_CHANGED, RECORD_PATTERN, RESTART
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
from tests.support.shards import id_samples

pytestmark = [pytest.mark.slow, TWO_HOSTS]  # network namespaces, rendezvous timeouts
__all__ = ["_two_hosts_possible"]  # the module's skip, where namespaces cannot be made

SAMPLES, BATCH = 160, 8  # 2 ranks: 10 steps an epoch
HANG = "sleep@train:step=6:attempt=0"  # host 1's rank, in the first attempt only


def _batches(path: Path) -> list[list[int]]:
    return (
        [[int(v) for v in ln.split()] for ln in path.read_text().splitlines()]
        if path.is_file()
        else []
    )


def _wait_for(found, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if (hit := found()) is not None:
            return hit
        time.sleep(0.2)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def _hang_injected(logs: Path) -> Path | None:
    for log in logs.glob("debug_rank1_*.log"):
        if "FAULT injected: sleep@train" in log.read_text(errors="replace"):
            return log
    return None


@pytest.fixture(scope="module")
def shrunk(tmp_path_factory) -> dict:
    tmp = tmp_path_factory.mktemp("shrink")
    data, keys, out = tmp / "data", tmp / "keys", tmp / "run"
    for i in range(4):
        write_shard(data / f"train-{i:06d}.tar", id_samples(40, start=40 * i))
    write_shard(data / "val-000000.tar", id_samples(16, start=1000))
    keys.mkdir()
    out.mkdir()
    args = [f"--train_shards={data}/train-{{000000..000003}}.tar",
            f"--val_shards={data}/val-000000.tar", "--model=tests.support.key_recorder:KeyRecorder",
            "--devices=1", f"--batch_size={BATCH}", "--num_workers=0", "--max_epochs=1",
            "--checkpointing_period=4", "--warmup_steps=1", "--max_restarts=1", "--min_nodes=1",
            "--debug=true", "--log_every_n_train_batches=1"]  # fmt: skip
    started = time.monotonic()
    with TwoHosts() as hosts:
        envs = [node_env(i, 29641, tmp, AE_TEST_KEYS=str(keys)) for i in (0, 1)]
        envs[1]["AE_FAULT"] = HANG
        procs = [start_node(hosts, i, args, envs[i], out) for i in (0, 1)]
        _wait_for(lambda: _hang_injected(out / "logs"), 240, "host 1's rank to hang at step 6")
        hosts.kill_host(1)  # the whole node: launcher, torchrun, rank
        # The first attempt's batches, before the second attempt (a rendezvous later) adds its own.
        first = {r: _batches(keys / f"rank{r}.txt") for r in (0, 1)}
        for f in keys.glob("rank*.txt"):
            f.unlink()
        code = procs[0].wait(timeout=300)
        elapsed = time.monotonic() - started
        found = {"out": out, "code": code, "first": first, "second": _batches(keys / "rank0.txt"),
                 "elapsed": elapsed, "json": diagnose_json(out / "logs", hosts)}  # fmt: skip
    found["console"] = console(out, 0)
    return found


def _restart_lines(text: str) -> list[dict[str, str]]:
    return [m for t in text.splitlines() if "RESTART" in t and (m := RESTART.parse(t))]


def test_host_0_goes_on_alone_and_says_which_node_it_lost(shrunk) -> None:
    text = shrunk["console"]
    assert shrunk["code"] == 0, text
    lines = _restart_lines(text)
    assert len(lines) == 1, text
    restart = lines[0]
    assert restart["attempt"] == "1" and restart["max"] == "1"
    assert restart["nodes"] == "; node1 lost: going on with 1 of 2 nodes (world 2 -> 1)", restart
    nodes = NODES_CHANGED.parse(restart["nodes"])
    assert nodes is not None and (nodes["before"], nodes["after"]) == ("2", "1")
    train_logs = sorted((shrunk["out"] / "logs").glob("train_*.log"))
    assert len(train_logs) == 2  # each attempt its own run TS
    second = train_logs[1].read_text()
    first_record = RECORD_PATTERN.match(second.splitlines()[0])
    assert first_record is not None and RESTART.parse(first_record["message"]) == restart
    assert "Training finished at step 16" in second  # 4 steps of 2 ranks, then 12 of one


def test_the_lr_and_the_data_plan_follow_the_world_of_one(shrunk) -> None:
    second = sorted((shrunk["out"] / "logs").glob("train_*.log"))[1].read_text()
    rescaled = [m for t in second.splitlines() if (m := LR_RESCALED.parse(t))]
    assert len(rescaled) == 1, second
    assert rescaled[0]["world"] == "1" and rescaled[0]["step"] == "4"
    assert float(rescaled[0]["old"]) == pytest.approx(float(rescaled[0]["new"]) * 2**0.5, rel=1e-4)
    # the rest of the epoch: 160 - 4 steps x 2 ranks x 8 = 96 samples, on one rank
    assert "re-split the rest of epoch 0 (96 samples not yet trained on)" in second, second


def test_every_sample_of_the_interrupted_epoch_is_trained_exactly_once(shrunk) -> None:
    restart = _restart_lines(shrunk["console"])[0]
    resume = int(restart["resume"])
    assert resume == 4  # the step-4 checkpoint; steps 5 and 6 of the first attempt are redone
    first = shrunk["first"]
    assert all(len(first[r]) >= resume for r in (0, 1)), first
    kept = [k for r in (0, 1) for batch in first[r][:resume] for k in batch]
    redone_after = [k for batch in shrunk["second"] for k in batch]
    assert len(shrunk["second"]) == (SAMPLES - len(kept)) // BATCH == 12
    assert sorted(kept + redone_after) == list(range(SAMPLES))
    # ae-diagnose's count per attempt agrees: 8 samples x 12 batches in the second attempt
    attempts = shrunk["json"]["attempts"]
    assert [a["status"] for a in attempts][-1] == "finished", attempts
    assert attempts[-1]["samples_per_epoch"] == {"0": 96}


def test_goodput_adds_up_to_the_wall_time_and_names_the_rendezvous_wait(shrunk) -> None:
    found = shrunk["json"]["goodput"]
    parts = found["parts"]
    assert found["attempts"] == 2
    span = log_span(shrunk["out"] / "logs")
    assert abs(sum(parts.values()) - found["wall_s"]) < 1.0, found
    assert abs(found["wall_s"] - span) < 1.0, (found, span)
    assert found["wall_s"] < shrunk["elapsed"]  # the launchers' own start is in no log
    # The rendezvous waited for node1's heartbeats to stop, then its last call: in the restart.
    assert parts["restart"] > LAST_CALL_S, parts
    assert parts["recompute"] > 0 and parts["training"] > 0, parts  # steps 5 and 6 redone
    line = next(t for t in shrunk["console"].splitlines() if "Goodput " in t)
    said = GOODPUT.parse(line)
    assert said is not None and said["attempts"] == "2", line
    assert abs(float(said["wall"]) - found["wall_s"]) < 0.1 and "restart " in said["parts"]
