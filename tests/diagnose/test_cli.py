"""ae-diagnose command line: run discovery, user mistakes, --json / table / --tail, --watch,
--bundle; and the byte-level log scanner under it."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pytest
from rich.console import Console

from ae.diagnose.cli import main
from ae.diagnose.log_files import find_run, list_runs
from ae.diagnose.logscan import LogBytes
from ae.diagnose.watch import watch
from bench.synthetic_logs import TS, RankWriter, write_heartbeat, write_train_log
from tests.support.runs import ROOT

OTHER_TS = "20261120_080000"


def finished_run(logs: Path, ts: str = TS, world: int = 2, exits: bool = True) -> list[RankWriter]:
    write_train_log(logs, world, ts=ts)
    out = []
    for rank in range(world):
        w = RankWriter(logs, rank, world, ts=ts)
        w.start()
        w.epoch(0, 1, 15)
        if exits:
            w.exit()
        w.flush()
        out.append(w)
    return out


def test_newest_run_is_picked_and_run_selects(tmp_path: Path) -> None:
    finished_run(tmp_path, OTHER_TS)
    old = time.time() - 3600
    for p in tmp_path.iterdir():
        os.utime(p, (old, old))
    finished_run(tmp_path, TS)
    assert set(list_runs(tmp_path)) == {TS, OTHER_TS}
    assert find_run(tmp_path).ts == TS
    assert find_run(tmp_path, OTHER_TS).ts == OTHER_TS


def test_one_of_a_runs_files_diagnoses_that_run(tmp_path: Path, capsys) -> None:
    """`ae-diagnose runs/ae/logs/debug_rank1_<TS>.log` (the log a user was reading) was refused:
    "not a folder"; it is that file's run now, even where a newer run shares the folder."""
    finished_run(tmp_path, OTHER_TS)
    finished_run(tmp_path, TS)  # the newest
    (log,) = tmp_path.glob(f"debug_rank1_{OTHER_TS}.log")
    capsys.readouterr()
    assert main([str(log), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["run"] == OTHER_TS
    stray = tmp_path / "notes.txt"
    stray.write_text("mine")
    assert main([str(stray)]) == 2
    assert "not a folder, nor a file of a run" in capsys.readouterr().err


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "ae.diagnose", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.mark.parametrize(
    "case", ["no folder", "no run", "unknown run", "bad tail", "two views", "goodput tail"]
)
def test_user_mistakes_give_one_message(tmp_path: Path, case: str) -> None:
    if case != "no folder":
        (tmp_path / "logs").mkdir()
    if case in ("unknown run", "bad tail", "two views", "goodput tail"):
        finished_run(tmp_path / "logs")
    args = {
        "no folder": [str(tmp_path / "nope")],
        "no run": [str(tmp_path / "logs")],
        "unknown run": [str(tmp_path), "--run", "19990101_000000"],
        "bad tail": [str(tmp_path), "--tail", "-1"],
        "two views": [str(tmp_path), "--watch", "--json"],
        "goodput tail": [str(tmp_path), "--goodput", "--tail", "5"],  # the tails were dropped
    }[case]
    res = run_cli(*args)
    assert res.returncode == 2, res
    assert "Traceback" not in res.stderr and res.stderr.count("\n") == 1, res.stderr
    expected = {"no folder": "no such folder", "no run": "no run in",
                "unknown run": f"newest runs: {TS}", "bad tail": "--tail",
                "two views": "--watch and --json are separate views of a run",
                "goodput tail": "--goodput and --tail are separate views"}[case]  # fmt: skip
    assert expected in res.stderr


def test_json_has_the_spec_keys(tmp_path: Path) -> None:
    finished_run(tmp_path / "logs")
    res = run_cli(str(tmp_path), "--json", "--tail", "2")  # the output dir: logs/ below it
    assert res.returncode == 0, res.stderr
    doc = json.loads(res.stdout)
    assert doc["run"] == TS and doc["culprits"] == [] and doc["status"] == "finished"
    for r in doc["ranks"]:
        assert {"rank", "phase", "step", "silent_s"} <= set(r)
        assert r["tail"][-1].endswith("Rank exiting with code 0: training finished")
    assert doc["logs_dir"] == str(tmp_path / "logs")


def test_table_names_the_culprit_with_evidence(tmp_path: Path, capsys) -> None:
    _, w1 = finished_run(tmp_path, exits=False)
    w1.stall("data loading", 3, 3.0, frame="_recv (multiprocessing/connection.py:430)")
    w1.flush()
    assert main([str(tmp_path), "--tail", "1"]) == 0
    out = capsys.readouterr().out
    assert "Verdict: held back by rank 1" in out and "data loading" in out
    assert f"debug_rank1_{TS}.log:" in out and "STALL detected" in out
    assert "Last lines of debug_rank0_" in out


GONE_PID = 4_194_000  # above the default pid_max: no such process


def test_watch_shows_every_rank_and_ends_with_the_job(tmp_path: Path) -> None:
    now = time.time()
    write_heartbeat(tmp_path, 0, 3, pid=os.getpid(), t=now, phase="training step", step=7)
    write_heartbeat(tmp_path, 1, 3, pid=os.getpid(), t=now, phase="data loading", step=6,
                    stalled=True, last_progress=now - 600)  # fmt: skip
    console = Console(record=True, width=250, force_terminal=False)
    watch(tmp_path, TS, console, interval=0.01, count=2)
    text = console.export_text()
    assert "training step" in text and "STALL" in text and "no heartbeat" in text  # rank 2
    assert re.search(r" 60[01] ", text)  # seconds since rank 1's last progress
    assert "code: step (model.py:1)" in text  # what rank 0's main thread is in
    rows1 = [line for line in text.splitlines() if line.startswith("│    1 ")]
    assert len(rows1) == 2  # not a terminal: each refresh printed
    assert "CULPRIT: data loading" in rows1[-1]  # the verdict's culprit, on its row
    # Rank 1's process dies: dead at the next refresh, and the watch ends (rank 0 exited).
    write_heartbeat(tmp_path, 0, 2, pid=os.getpid(), t=now, phase="teardown", step=9,
                    state="exited")  # fmt: skip
    write_heartbeat(tmp_path, 1, 2, pid=GONE_PID, t=now, phase="data loading", step=6,
                    stalled=True, last_progress=now - 600)  # fmt: skip
    console = Console(record=True, width=250, force_terminal=False)
    watch(tmp_path, TS, console, interval=60)  # returns at once: every rank ended
    (row1,) = [line for line in console.export_text().splitlines() if line.startswith("│    1 ")]
    assert "│ dead " in row1
    for rank in (0, 1):
        write_heartbeat(tmp_path, rank, 2, pid=os.getpid(), t=now, phase="teardown", step=9,
                        state="exited")  # fmt: skip
    console = Console(record=True, width=250, force_terminal=False)
    watch(tmp_path, TS, console, interval=60)  # returns at once: every rank exited
    assert console.export_text().count("exited") == 2


def test_watch_without_heartbeats_is_a_user_mistake(tmp_path: Path) -> None:
    finished_run(tmp_path)
    res = run_cli(str(tmp_path), "--watch")
    assert res.returncode == 2 and "no heartbeat files" in res.stderr


def test_bundle(tmp_path: Path) -> None:
    finished_run(tmp_path / "logs")
    write_heartbeat(tmp_path / "logs", 0, 2, pid=1, t=time.time(), phase="teardown", step=15,
                    state="exited")  # fmt: skip
    out = tmp_path / "report.tar.gz"
    assert main([str(tmp_path / "logs"), "--bundle", str(out)]) == 0
    root = f"ae-bundle-{TS}"
    with tarfile.open(out) as tar:
        names = set(tar.getnames())
        assert {f"{root}/logs/train_{TS}.log", f"{root}/logs/debug_rank1_{TS}.log",
                f"{root}/logs/heartbeat_rank0_{TS}.json", f"{root}/diagnosis.json",
                f"{root}/diagnosis.txt", f"{root}/config.yaml", f"{root}/environment.txt",
                f"{root}/tails/rank0.log", f"{root}/tails/rank1.log"} <= names  # fmt: skip
        env = tar.extractfile(f"{root}/environment.txt").read().decode()  # type: ignore[union-attr]
        config = tar.extractfile(f"{root}/config.yaml").read().decode()  # type: ignore[union-attr]
        diag = json.load(tar.extractfile(f"{root}/diagnosis.json"))  # type: ignore[arg-type]
    assert "torch==" in env and "nvidia-smi:" in env and "stall_timeout: 3.0" in config
    assert diag["run"] == TS
    assert main([str(tmp_path / "logs"), "--bundle", str(tmp_path / "no" / "x.tar.gz")]) == 2


def test_logscan_records_and_continuations(tmp_path: Path) -> None:
    w = RankWriter(tmp_path, 0, 2)
    w.log("first")
    w.log("an error about shard a.tar", "ERROR")
    w.fatal("ValueError", "boom", [("/x/ae/training/model.py", "training_step")])
    w.raw("2026 | ERROR    | not a record", "   | ERROR    | nor this")
    path = w.flush()
    log = LogBytes.read(path)
    assert log.count_level("ERROR") == 1 and log.count_level("CRITICAL") == 1
    start = log.last_record()
    assert start is not None and "FATAL" in log.text(start) and log.lineno(start) == 3
    cont = [log.text(p) for p in log.continuation(start, 100)]
    assert cont[0] == "Traceback (most recent call last):"
    assert cont[-1] == "   | ERROR    | nor this"
    n = len(path.read_text().splitlines())
    assert [(e.line, e.text) for e in log.tail(2)] == [(n - 1, cont[-2]), (n, cont[-1])]
    assert [log.lineno(p) for p in log.find_records(b"shard")] == [2]


def test_importing_one_module_loads_only_what_it_needs() -> None:
    """The package's `__init__` holds no logic: the log scanner alone does not pull in the
    analyzer (verdict rules, run state, report)."""
    script = (
        "import sys, ae.diagnose.logscan\n"
        "print(sorted(m for m in sys.modules if m.startswith('ae.diagnose')))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["['ae.diagnose',", "'ae.diagnose.logscan']"]


@pytest.mark.parametrize("width", [80, 120])
def test_watch_is_readable_on_a_narrow_terminal(tmp_path: Path, width: int) -> None:
    """At 80 and 120 columns each row still shows its rank, state, epoch, step, seconds since
    progress and the verdict in full (the less needed columns are left out, long text wraps),
    and no line is wider than the console."""
    now = time.time()
    main = "collective: all_reduce (DDP gradient all-reduce in backward)"
    write_heartbeat(tmp_path, 0, 2, pid=os.getpid(), t=now, phase="training step", step=1234,
                    main=main)  # fmt: skip
    write_heartbeat(tmp_path, 1, 2, pid=os.getpid(), t=now, phase="data loading", step=1233,
                    stalled=True, last_progress=now - 600)  # fmt: skip
    console = Console(record=True, width=width, force_terminal=False)
    watch(tmp_path, TS, console, interval=0.01, count=1)
    lines = console.export_text().splitlines()
    assert all(len(line) <= width for line in lines)
    header = next(line for line in lines if "rank" in line)
    cells = [c.strip() for c in header.strip("┃").split("┃")]
    assert cells[:2] == ["rank", "state"] and {"epoch", "step", "idle s", "verdict"} <= set(cells)
    rows = [
        dict(zip(cells, (c.strip() for c in line.strip("│").split("│")), strict=True))
        for line in lines
        if re.match(r"│ +\d+ │", line)  # a rank's first line (its wrapped text follows)
    ]
    assert [(r["rank"], r["state"], r["epoch"], r["step"]) for r in rows] == [
        ("0", "running", "0", "1234"),
        ("1", "running", "0", "1233"),
    ]
    assert rows[0]["idle s"] == "0" and rows[1]["idle s"] in ("600", "601")
    assert rows[1]["verdict"].startswith("CULPRIT: data")


@pytest.mark.parametrize(("launcher_log", "status", "why"), [
    ("W1128 02:12:35.585000 29511 api.py:753] Received 2 death signal, shutting down workers\n",
     "STOPPED", "torchrun got a stop signal first"),
    ("torch.distributed.DistStoreError: Timed out after 601 seconds waiting for clients\n",
     "FAILED", "torchrun failed: its output says why"),
    ("", "RUNNING", "torchrun has written nothing yet: it waits for the other nodes"),
])  # fmt: skip
def test_a_run_whose_ranks_never_started_is_not_finished(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], launcher_log: str, status: str, why: str
) -> None:
    """Was: `? ranks, FINISHED ... no rank holds the job back (finished)` for a run stopped by
    Ctrl-C in its startup, before any rank wrote a line (only torchrun's launcher log)."""
    (tmp_path / f"launcher_{TS}.log").write_text(launcher_log)
    assert main([str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert f"? ranks, {status}" in out and "FINISHED" not in out
    assert f"Verdict: no rank has started; {why}" in " ".join(out.split())
