"""End-to-end collective mismatches: a collective that only rank 1 calls, once (2 ranks, gloo).

Two launches, each kind and each way of making it once (tests/diagnose/test_collectives.py has
the other two, on the dumps and logs of such runs):
1. a user model whose loss() all-reduces a tensor the size of the gradient bucket on rank 1: it
   pairs with rank 0's gradient all-reduce, then the job hangs; diagnosed live (`--dump`), then
   dead, when --pg_timeout ends it;
2. `AE_FAULT=desync@train:rank=1:step=3`: 3 numbers, gloo aborts rank 1 (SIGABRT).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.live import diagnose, wait_for
from tests.support.runs import ROOT, SERIAL, run_launcher

pytestmark = [pytest.mark.slow, SERIAL]  # stall and pg timeouts

MODEL = "tests.support.desync_models"
BUCKET = 3224  # TinyAutoEncoder's parameters on 16-number vectors: one gradient bucket


def shard_args(make_shards) -> list[str]:
    train = make_shards([80, 80, 80], name="train")  # 15 batches of 8 per rank
    val = make_shards([32], name="val")
    return [f"--train_shards={train}", f"--val_shards={val}", "--batch_size=8", "--max_epochs=1",
            "--num_workers=0", "--stall_timeout=3"]  # fmt: skip


def user_call_site() -> str:
    """`tests/support/desync_models.py:N`: the line of the extra all-reduce."""
    path = ROOT / "tests" / "support" / "desync_models.py"
    (n,) = [i for i, line in enumerate(path.read_text().splitlines(), 1) if "all_reduce(" in line]
    return f"tests/support/desync_models.py:{n}"


def test_users_extra_collective_the_size_of_the_bucket_hangs(make_shards, tmp_path: Path) -> None:
    out, site = tmp_path / "run", user_call_site()
    logs = out / "logs"
    args = [*shard_args(make_shards), f"--model={MODEL}:BucketExtraCollective",
            "--pg_timeout=20"]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k not in ("AE_RUN_TS", "MASTER_PORT")}
    env["AE_CACHE_DIR"] = str(tmp_path / "cache")
    console = tmp_path / "console.txt"
    with console.open("w") as sink:
        launcher = subprocess.Popen(
            [sys.executable, "-m", "ae.cli.launch", f"--output_dir={out}", *args],
            cwd=ROOT, env=env, stdout=sink, stderr=subprocess.STDOUT,
        )  # fmt: skip
        try:
            # Live: each rank's first STALL report dumped its collectives; --dump asks again.
            wait_for(
                "a collectives dump of each rank",
                lambda: len(list(logs.glob("collectives_rank*"))) == 2,
            )
            doc = json.loads(diagnose(logs, "--dump", "--json"))
            assert doc["status"] == "hung", doc["culprits"]
            assert [(c["rank"], c["cause"]) for c in doc["culprits"]] == [
                (1, "collective mismatch")
            ]
            assert {d["reason"] for d in doc["collectives"]["dumps"]} == {"requested"}
            (m,) = doc["collectives"]["mismatches"]
            assert (m["kind"], m["ranks"]) == ("extra", [1])
            (call,) = m["calls"]
            assert (call["op"], call["sizes"], call["seq"]) == ("all_reduce", [[BUCKET]], m["seq"])
            assert call["site"] == f"{site} (loss)"
            # DDP's gradient all-reduce: from torch's autograd hook, or through ae's comm hook
            # (the non-finite check of issue 36 reduces the buckets)
            others = m["others"][0]["site"]
            assert others.startswith(("torch/autograd/graph.py", "ae/training/nonfinite")), others
            table = diagnose(logs)
            assert "rank 1 on " in table and ": collective mismatch" in table
            assert f"all_reduce [{BUCKET}] Float at {site} (loss)" in table
            launcher.wait(timeout=180)  # dead: --pg_timeout ends the hang
        finally:
            launcher.kill()
    text = console.read_text()
    assert launcher.returncode != 0
    assert "Training failed: rank 1 on " in text and "collective mismatch" in text, text[-3000:]
    assert f"all_reduce [{BUCKET}] Float at {site} (loss): the others did not call it" in text


def test_injected_extra_collective_of_three_numbers_aborts(make_shards, tmp_path: Path) -> None:
    res = run_launcher(
        [*shard_args(make_shards), "--model=tests.support.my_autoencoder:TinyAutoEncoder"],
        tmp_path / "run", env={"AE_FAULT": "desync@train:rank=1:step=3"},
    )  # fmt: skip
    assert res.returncode != 0
    head = "phase training step: collective mismatch"
    assert "Training failed: rank 1 on " in res.output and head in res.output, res.output[-3000:]
    tail = res.output[-3000:]
    assert "ae/forensics/faults.py:" in res.output, tail  # the call site, from the fatal stack
    assert "(_injected_desync) called all_reduce while rank 0 was in #" in res.output, tail
    assert f"all_reduce [{BUCKET}] Float" in res.output, tail
    doc = json.loads(diagnose(res.logs, "--json"))
    (c,) = doc["culprits"]
    assert (c["rank"], c["cause"]) == (1, "collective mismatch")
    assert any("collective mismatch in your code?" in e["text"] for e in c["evidence"])
    (m,) = doc["collectives"]["mismatches"]
    assert (m["kind"], m["ranks"]) == ("backend", [1])
    assert m["others"][0]["sizes"] == [[BUCKET]] and m["others"][0]["op"] == "all_reduce"
    assert "desync@train" in res.text("debug_rank1_*.log")  # the fault's own line
