"""`ae-diagnose --timeline` and `--trace` on the logs of a real stalled run (committed under
tests/fixtures/stalled_run: 2 gloo ranks, `AE_FAULT=sleep@train:rank=1:step=40`,
`--stall_timeout=4 --pg_timeout=20`; rank 0 waited in the gradient all-reduce until its
collective timed out). The README's picture is this run's timeline."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

from PIL import Image

from ae.diagnose.log_files import find_run
from ae.diagnose.timeline import PHASES, build_timeline
from tests.support.runs import ROOT

FIXTURE = ROOT / "tests" / "fixtures" / "stalled_run"


def test_timeline_of_a_stalled_run_has_a_lane_per_rank_and_the_stall(tmp_path: Path) -> None:
    tl = build_timeline(find_run(FIXTURE))
    assert tl.ranks == [0, 1] and tl.culprits == {1: "training step"}
    lanes = {r: [s for s in tl.spans if s.rank == r] for r in tl.ranks}
    for spans in lanes.values():
        phases = [s.phase for s in sorted(spans, key=lambda s: s.start)]
        assert phases[0] == "setup" and {"step", "validation", "checkpoint"} <= set(phases)
        assert all(s.end >= s.start and s.phase in PHASES for s in spans)
    # rank 1 stalled in its own step to the end; rank 0 waited for it, failed, and is dead
    (stall,) = [s for s in lanes[1] if s.phase == "stalled"]
    assert stall.end == tl.end and stall.detail == "training step, step 40"
    (wait,) = [s for s in lanes[0] if s.phase == "waiting"]
    (dead,) = [s for s in lanes[0] if s.phase == "dead"]
    assert wait.start < dead.start == wait.end and dead.end == tl.end
    assert {(m.rank, m.kind) for m in tl.marks} == {(0, "STALL"), (1, "STALL"), (0, "FATAL")}


def test_a_victim_without_a_stall_report_of_its_own_is_drawn_waiting(tmp_path: Path) -> None:
    """The same run as if rank 0 had written no STALL report (the culprit's --hang_timeout
    ending the job before rank 0's --stall_timeout): the verdict still names it a victim, and
    its lane waits from the culprit's stall on, not `step` to the end."""
    run = tmp_path / "run"
    shutil.copytree(FIXTURE, run)
    log = next(run.glob("debug_rank0_*.log"))
    records = re.split(r"(?m)^(?=\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d+ \|)", log.read_text())
    log.write_text("".join(r for r in records if "] STALL " not in r.split("\n", 1)[0]))
    tl = build_timeline(find_run(run))
    (stall,) = [s for s in tl.spans if s.rank == 1 and s.phase == "stalled"]
    (wait,) = [s for s in tl.spans if s.rank == 0 and s.phase == "waiting"]
    assert wait.start == stall.start and wait.end > wait.start
    assert wait.detail == "waiting for rank 1 (the verdict; no STALL report of its own)"


def test_timeline_png_and_trace_json_from_the_command_line(tmp_path: Path) -> None:
    logs = tmp_path / "logs"
    shutil.copytree(FIXTURE, logs)
    png, trace = tmp_path / "timeline.png", tmp_path / "trace.json"
    res = subprocess.run(
        [sys.executable, "-m", "ae.diagnose", str(logs), "--timeline", str(png),
         "--trace", str(trace)],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr
    assert f"{png} (2 ranks)" in res.stdout and f"{trace} (2 ranks)" in res.stdout
    with Image.open(png) as img:
        assert img.format == "PNG" and img.width >= 1000 and img.height >= 200
    doc = json.loads(trace.read_text())
    events = doc["traceEvents"]
    threads = {e["tid"]: e["args"]["name"] for e in events if e["name"] == "thread_name"}
    assert threads == {0: "rank 0", 1: "rank 1 (culprit: training step)"}
    stalls = {e["tid"] for e in events if e["ph"] == "i" and e["name"] == "STALL"}
    assert stalls == {0, 1}
    spans = [e for e in events if e["ph"] == "X"]
    assert {(e["tid"], e["name"]) for e in spans} >= {(1, "stalled"), (0, "waiting"), (0, "dead")}
    assert all(isinstance(e["ts"], int) and e["dur"] > 0 for e in spans)
    for rank in (0, 1):  # on one thread, complete events nest or follow each other
        open_ends: list[int] = []
        for e in sorted((e for e in spans if e["tid"] == rank), key=lambda e: e["ts"]):
            while open_ends and open_ends[-1] <= e["ts"]:
                open_ends.pop()
            assert not open_ends or e["ts"] + e["dur"] <= open_ends[-1], e
            open_ends.append(e["ts"] + e["dur"])
    assert doc["otherData"]["verdict"] == "held back by rank 1: training step"


def test_nonfinite_and_spike_lines_are_marks_on_their_rank(tmp_path: Path) -> None:
    from ae.log_lines import LOSS_SPIKE, NONFINITE
    from bench.synthetic_logs import RankWriter, write_train_log

    write_train_log(tmp_path, 2)
    for rank in (0, 1):
        w = RankWriter(tmp_path, rank, 2)
        w.start()
        w.steps(1, 6)
        if rank == 1:
            w.log(
                LOSS_SPIKE.format(
                    loss=4.0,
                    rank=1,
                    step=3,
                    epoch=0,
                    batch=2,
                    ratio=12.0,
                    mean=0.33,
                    samples="shard a.tar, keys [k]",
                ),
                "WARNING",
            )
            w.log(NONFINITE.format(value="loss=nan", rank=1, step=5, epoch=0, batch=4,
                                   samples="shard a.tar, keys [k]"), "ERROR")  # fmt: skip
        w.flush()
    tl = build_timeline(find_run(tmp_path))
    marks = {(m.rank, m.kind, m.text) for m in tl.marks}
    assert marks == {
        (1, "SPIKE", "LOSS SPIKE step 3"),
        (1, "NONFINITE", "NONFINITE loss=nan step 5"),
    }
