"""End-to-end: the real launcher (torchrun, 2 gloo ranks on CPU) over real tar shards."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ae.job.folder_lock import read_lock
from ae.log_lines import EPOCH_STEP_TIMES, THROUGHPUT
from tests.support.live import diagnose_json
from tests.support.runs import ROOT, SERIAL, run_launcher

pytestmark = pytest.mark.slow

SPEC_GREPS = {  # SPEC grep table (but STALL and ERROR): pattern -> files it must match in
    r"EPOCH.*START|EPOCH.*END": "debug_rank0_*.log",
    r"Processing.*files": "debug_rank*.log",
    r"COMPLETED iteration": "debug_rank*.log",
    r"Processed.*training batches": "debug_rank0_*.log",
    r"Training step": "debug_rank0_*.log",
    r"Validation step": "debug_rank0_*.log",
}


def test_debug_run_writes_every_spec_line_and_diagnoses_clean(launch, make_shards) -> None:
    train = make_shards([40, 40, 30, 20], name="train")
    val = make_shards([24], name="val")
    res = launch(
        [f"--train_shards={train}", f"--val_shards={val}", "--debug=true", "--max_epochs=2",
         "--batch_size=8", "--num_workers=2", "--log_every_n_train_batches=3"],
    )  # fmt: skip
    assert res.returncode == 0, res.output
    (train_log,) = res.log("train_*.log")
    ts = train_log.name[len("train_") : -len(".log")]
    assert [p.name for p in res.log("debug_rank*.log")] == [
        f"debug_rank0_{ts}.log",
        f"debug_rank1_{ts}.log",
    ]
    for pattern, files in SPEC_GREPS.items():
        for path in res.log(files):
            assert re.search(pattern, path.read_text()), f"{pattern!r} not in {path.name}"
    for rank in (0, 1):
        text = res.text(f"debug_rank{rank}_*.log")
        for epoch in (0, 1):
            for stage in ("TRAINING", "VALIDATION"):
                for edge in ("START", "END"):
                    assert f"========== EPOCH {epoch} {stage} {edge} ==========" in text
        # every line carries the rank tag; worker lines carry the worker tag
        for line in text.splitlines():
            if re.match(r"\d{4}-\d\d-\d\d ", line):
                assert f"[Rank {rank}/2" in line, line
        assert re.search(rf"\[Rank {rank}/2 Worker [01]/2\] Processing \d+/4 files", text)
        assert re.search(r"pid=\d+ host=", text) and "nccl_available=" in text
        # equal split: both ranks run 130 // (2 * 8) = 8 batches per epoch
        assert re.findall(r"Processed (\d+) training batches \(epoch 0", text)[-1] == "8"
        # with --debug each step says where its time went (ms): own = data + compute, and sync
        steps = re.findall(r"Training step \d+, .* samples/s, own=([\d.]+)ms \(data ([\d.]+), "
                           r"compute ([\d.]+)\), sync=[\d.]+ms, rss=", text)  # fmt: skip
        assert len(steps) == 16
        assert all(float(o) == pytest.approx(float(d) + float(c), abs=0.11) for o, d, c in steps)
    main = train_log.read_text()
    # per epoch, the spread of the ranks' own time per step
    spreads = [m for line in main.splitlines() if (m := EPOCH_STEP_TIMES.parse(line))]
    assert [(m["epoch"], m["ranks"]) for m in spreads] == [("0", "2"), ("1", "2")]
    for m in spreads:
        assert float(m["own_min"]) <= float(m["own_median"]) <= float(m["own_max"])
        assert m["slowest"] in ("0", "1") and 0 <= float(m["data_max"]) <= 100
    # and after it the epoch's throughput, the slowest rank's split and what bounds the job:
    # 2 ranks x 8 samples a step
    rates = [m for line in main.splitlines() if (m := THROUGHPUT.parse(line))]
    assert [m["epoch"] for m in rates] == ["0", "1"]
    for m in rates:
        assert float(m["samples_per_s"]) == pytest.approx(16_000 / float(m["step_ms"]), rel=0.01)
        assert m["verdict"].split("-bound: ")[0] in ("input", "compute", "sync")
    assert "Setup: distributed, world size 2" in main and "Resolved config:" in main
    assert "Training step" not in main  # details stay in the rank logs
    assert "has `__len__` defined" not in main  # Lightning's warning is silenced, as intended
    # No WARNING line in a healthy run: a user greps WARNING for what needs them. (Lightning's
    # deprecated all_gather is not called; third-party warnings that say nothing true about an
    # ae rank are kept out: logging_cfg.stdlib.IDLE_WARNINGS, e.g. srun's, 8 batches an epoch.)
    assert [line for line in main.splitlines() if "| WARNING" in line] == []
    assert "tail -f" in res.output
    # ae-diagnose of a clean run: no culprit, no victim, no straggler, both ranks exited at the
    # last step (this launch stands for a clean run in tests/e2e/test_diagnose.py too)
    doc = diagnose_json(res.logs)
    assert doc["culprits"] == [] and doc["victims"] == [] and doc["status"] == "finished"
    assert doc["stragglers"] == []
    assert [(r["rank"], r["state"], r["step"]) for r in doc["ranks"]] == [
        (0, "exited", 16),
        (1, "exited", 16),
    ]


@SERIAL  # refused within 10 s
@pytest.mark.parametrize("flag", ["--batch_size=-1", "--no_such_flag=3"])
def test_bad_flag_fails_fast_without_workers(tmp_path: Path, flag: str) -> None:
    t0 = time.monotonic()
    res = run_launcher([flag, "--max_restarts=3"], tmp_path / "run")
    assert res.returncode == 2  # a user error: never restarted
    assert time.monotonic() - t0 < 10
    assert "RESTART" not in res.output
    assert flag[2:].split("=")[0] in res.output
    assert "Traceback" not in res.output
    assert not (tmp_path / "run" / "logs").exists()  # no rank ever started


def test_shards_matching_nothing_named(tmp_path: Path) -> None:
    res = run_launcher([f"--train_shards={tmp_path}/nothing-*.tar"], tmp_path / "run")
    assert res.returncode == 2 and "train_shards" in res.output and "matches no shard" in res.output


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_nodes_on_localhost(tmp_path: Path, make_shards) -> None:
    """Two launcher invocations (NNODES=2, NODE_RANK=0/1, one process each) form one job."""
    train = make_shards([30, 30], name="train")
    val = make_shards([16], name="val")
    out = tmp_path / "run"
    env = {"NNODES": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port())}
    args = [f"--output_dir={out}", f"--train_shards={train}", f"--val_shards={val}",
            "--devices=1", "--max_epochs=1", "--batch_size=4", "--num_workers=1"]  # fmt: skip
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "ae.cli.launch", *args],
            cwd=ROOT,
            env={**os.environ, **env, "NODE_RANK": str(node), "AE_CACHE_DIR": str(tmp_path)},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for node in (0, 1)
    ]
    end = time.monotonic() + 120  # one process of the job holds the folder's lock: node 0's
    while (holder := read_lock(out / "run.lock")) is None and time.monotonic() < end:
        time.sleep(0.05)
    assert holder is not None and holder.pid == procs[0].pid
    assert holder.job == f"multi-node job at 127.0.0.1:{env['MASTER_PORT']}"
    outputs = [p.communicate(timeout=240)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outputs
    # each node's console names its part of the job, and says how it ended
    assert "Training on node 0/2" in outputs[0] and "Training on node 1/2" in outputs[1]
    assert all("Done. Logs: " in text for text in outputs), outputs
    logs = out / "logs"
    ranks = sorted(p.name.split("_")[1] for p in logs.glob("debug_rank*.log"))
    assert ranks == ["rank0", "rank1"]  # one shared TS: exactly one file per rank
    for path in logs.glob("debug_rank*.log"):
        text = path.read_text()
        assert "EPOCH 0 TRAINING END" in text and "world_size=2" in text
    assert len(list(logs.glob("train_*.log"))) == 1
