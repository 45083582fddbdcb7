"""ae-diagnose on a run with a straggler: scores from the heartbeats, the ranks named by the
detector's lines, the verdict of a running job, --json and --watch. Synthetic files written with
the real formats."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from rich.console import Console

from ae.diagnose.heartbeats import read_heartbeat
from ae.diagnose.log_files import find_run
from ae.diagnose.report import diagnose, render
from ae.diagnose.watch import _Rates, read_beats, watch_table
from ae.log_lines import STRAGGLER, STRAGGLER_RESOLVED, TRAIN_LOG_FILE
from bench.synthetic_logs import TS, RankWriter, record, write_heartbeat, write_train_log

LINE = STRAGGLER.format(
    rank=1, score="1.5", window="60", cause="data",
    evidence="83% of it waiting for data; worker 0 reads /d/a.tar at 0.40 MB/s, 50.0 ms per batch",
)  # fmt: skip


def window(own: float, data: float) -> dict[str, float]:
    return {"window_s": 30.0, "steps": 300, "step_ms": 35.0, "own_ms": own, "data_ms": data,
            "compute_ms": own - data, "sync_ms": 35.0 - own}  # fmt: skip


def live_run(logs: Path, *train_lines: str) -> float:
    """Two ranks training now; rank 1 waits for data. Returns now."""
    now = time.time()
    write_train_log(logs, 2)
    with (logs / TRAIN_LOG_FILE.format(ts=TS)).open("a") as f:
        f.writelines(record(now - 1, "WARNING", 0, 2, line) + "\n" for line in train_lines)
    workers = [{"worker": 0, "pid": 9, "shard": "/d/a.tar", "mb_per_s": 0.4, "batch_ms": 50.0,
                "batches": 300}]  # fmt: skip
    episodes = [{"rank": 1, "score": 1.5, "cause": "data", "since": now - 70, "line": LINE,
                 "resolved": None}]  # fmt: skip
    for rank, (own, data) in enumerate(((10.0, 1.0), (30.0, 25.0))):
        w = RankWriter(logs, rank, 2, t=now - 5)
        w.start()
        w.steps(1, 10, dt=0.1)
        w.flush()
        write_heartbeat(
            logs, rank, 2, pid=os.getpid(), t=now, phase="training step", step=10,
            timing={"recent": window(own, data), "epoch": window(own, data)},
            data_workers=workers if rank == 1 else [],
            stragglers=episodes if rank == 0 and len(train_lines) == 1 else [],
        )  # fmt: skip
    return now


def test_running_job_slowed_by_rank_1(tmp_path: Path) -> None:
    live_run(tmp_path, LINE)
    doc = diagnose(find_run(tmp_path))
    assert doc["status"] == "running" and doc["culprits"] == []
    assert [(r["rank"], r["score"]) for r in doc["ranks"]] == [(0, 0.33), (1, 3.0)]
    assert doc["ranks"][1]["step_time"]["data_ms"] == 25.0
    ((straggler),) = doc["stragglers"]
    assert (straggler["rank"], straggler["score"], straggler["cause"]) == (1, 3.0, "data")
    line, now = straggler["evidence"]
    assert line["file"] == f"train_{TS}.log" and LINE in line["text"]
    assert now["file"] == f"heartbeat_rank1_{TS}.json" and now["text"].startswith(
        "now: own 30.0 ms per step (data 25.0, compute 5.0), sync 5.0 ms, over the last 30 s"
    )
    assert "worker 0 reads /d/a.tar at 0.40 MB/s" in now["text"]
    console = Console(record=True, width=250)
    render(doc, console)
    text = console.export_text()
    assert "Verdict: running, slowed by rank 1: data" in text
    assert "3.0x data" in text and "0.3x" in text  # the score column
    assert "rank 1: 3.0x, cause data" in text


def test_resolved_straggler_is_no_longer_listed(tmp_path: Path) -> None:
    resolved = STRAGGLER_RESOLVED.format(rank=1, seconds="80", score="1.1")
    live_run(tmp_path, LINE, resolved)
    doc = diagnose(find_run(tmp_path))
    assert doc["stragglers"] == [] and doc["ranks"][1]["score"] == 3.0  # scores stay


def test_watch_shows_scores_and_marks_the_straggler(tmp_path: Path) -> None:
    now = live_run(tmp_path, LINE)
    console = Console(record=True, width=250)
    console.print(watch_table(TS, read_beats(tmp_path, TS), _Rates(), now))
    text = console.export_text()
    rows = {line.split()[1]: line for line in text.splitlines() if "│" in line}
    assert "own ms" in text
    assert "0.3x" in rows["0"] and "STRAGGLER" not in rows["0"]
    assert "30.0" in rows["1"] and "3.0x STRAGGLER data" in rows["1"]


def test_heartbeat_of_an_older_version_still_reads(tmp_path: Path) -> None:
    path = write_heartbeat(tmp_path, 0, 2, pid=1, t=time.time(), phase="training step", step=3)
    raw = json.loads(path.read_text())
    for key in ("timing", "data_workers", "stragglers"):
        del raw[key]
    path.write_text(json.dumps(raw))
    beat = read_heartbeat(path)
    assert beat is not None and beat.step == 3 and beat.timing is None


def test_a_healthy_but_input_bound_run_says_where_the_time_goes(tmp_path: Path) -> None:
    """No straggler, no culprit: both ranks wait for their batches most of their own time (a
    2-rank run with --num_workers=1 whose data is slow). The verdict has nothing to name, and
    the diagnosis still says what bounds the job and what would feed it."""
    now = time.time()
    write_train_log(tmp_path, 2, num_workers=1)
    for rank in (0, 1):
        w = RankWriter(tmp_path, rank, 2, t=now - 5)
        w.start()
        w.steps(1, 10, dt=0.1)
        w.flush()
        mine = {**window(150.0 + rank, 140.0 + rank), "sync_ms": 6.0}
        write_heartbeat(
            tmp_path, rank, 2, pid=os.getpid(), t=now, phase="training step", step=10,
            timing={"recent": mine, "epoch": mine},
        )  # fmt: skip
    doc = diagnose(find_run(tmp_path))
    assert doc["culprits"] == [] and doc["stragglers"] == []
    bound = doc["bound"]
    assert (bound["rank"], bound["bound"], bound["data_ms"]) == (1, "input", 141.0)
    assert bound["words"].startswith("input-bound: rank 1 waits for data 93% of its own time")
    assert "raise --num_workers (now 1 per rank" in bound["words"]  # node0 holds both ranks
    console = Console(record=True, width=250)
    render(doc, console)
    text = console.export_text()
    assert "Verdict: no rank holds the job back (running)." in text
    where = "Where the time goes (rank 1's heartbeat, last 30 s): data wait 141, compute 10, sync 6"
    assert where + " ms per step; input-bound: rank 1" in text
