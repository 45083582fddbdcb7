"""Memory figures: the cheap per-step reader and the stall report's process table."""

from __future__ import annotations

import multiprocessing as mp
import os
import re
import subprocess
import sys
import time

import psutil
import pytest

from ae.forensics import process_stats
from ae.forensics.process_stats import RssReader, memory_summary, process_table


def test_rank_and_worker_rss(monkeypatch: pytest.MonkeyPatch) -> None:
    # The summary is cached for SUMMARY_REFRESH_S: one that an earlier test of this worker
    # process read (without a child then) must not answer for this one.
    monkeypatch.setattr(process_stats, "_summary", (float("-inf"), ""))
    ctx = mp.get_context("fork")
    ready = ctx.Event()
    child = ctx.Process(target=lambda: (ready.set(), time.sleep(30)), daemon=True)
    child.start()
    try:
        assert ready.wait(10)
        reader = RssReader()
        rss, children = reader.sample()
        assert rss > 10 and child.pid in children and children[child.pid] > 1
        assert re.fullmatch(r"rss=\d+MB workers=\d+x\d+MB", memory_summary())
        table = process_table(cpu_window_s=0.05)
        assert table[0].startswith(f"rank    pid={os.getpid()} status=")
        assert any(line.startswith(f"worker  pid={child.pid} ") for line in table)
        assert all("fds=" in line and "cpu=" in line for line in table)
    finally:
        child.kill()
        child.join()
    time.sleep(0.1)
    reader.listed_at = float("-inf")  # re-list now rather than in CHILDREN_REFRESH_S
    assert child.pid not in reader.sample()[1]


def test_a_command_reading_a_shard_is_shown_with_its_command_line() -> None:
    """A stall in a remote read showed `worker ... cmd=curl`: which shard it waited for was in
    no line of the report. A non-Python child is a command (curl, a `pipe:` shell), not a
    dataloader worker."""
    url = "http://127.0.0.1:9/data/train-000003.tar"
    child = subprocess.Popen(["cat", "-", url], stdin=subprocess.PIPE)  # blocked on stdin
    try:
        time.sleep(0.1)
        table = process_table(cpu_window_s=0.05)
        line = next(line for line in table if f"pid={child.pid} " in line)
        assert line.startswith("child ") and line.endswith(f"cmd=cat - {url}")
    finally:
        child.kill()
        child.wait()


def test_kill_descendants_leaves_no_grandchild_behind() -> None:
    """A rank's worker and the command it reads through (here: a shell and its sleep, the
    grandchild) are killed with it; before, a rank's hang-timeout exit left a curl orphaned."""
    script = "import subprocess, sys, time; p = subprocess.Popen(['sleep', '300']); " \
             "print(p.pid, flush=True); time.sleep(300)"  # fmt: skip
    child = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None
        grandchild = int(child.stdout.readline())
        assert process_stats.kill_descendants(child.pid) == 1
        # Dead: a zombie until its parent (here still alive, not reaping) is gone, or reaped
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and _alive(grandchild):
            time.sleep(0.05)
        assert not _alive(grandchild)
        assert child.poll() is None  # the process itself is left to end on its own
    finally:
        child.kill()
        child.wait()


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
