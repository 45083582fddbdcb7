"""The suite reports its own slowest tests: tests.support.durations writes them, slowest first,
to `.pytest_durations.txt` in the rootdir, also when a test fails (what .ci/run prints)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from tests.support.durations import FILE_NAME
from tests.support.runs import ROOT

TESTS = """
import subprocess, sys, time

def test_quick():
    pass

def test_sleeps():
    time.sleep(0.6)

def test_computes_in_a_subprocess():
    subprocess.run([sys.executable, "-c", "sum(range(20_000_000))"], check=True)

def test_fails():
    time.sleep(0.3)
    assert False
"""


def test_the_slowest_tests_are_written_slowest_first_with_their_cpu(tmp_path: Path) -> None:
    (tmp_path / "test_some.py").write_text(TESTS)
    res = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "tests.support.durations", "-p", "no:cacheprovider",
         f"--rootdir={tmp_path}", "-c", "/dev/null", str(tmp_path / "test_some.py")],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert res.returncode == 1, res.stdout + res.stderr  # the failing test
    head, *rows = (tmp_path / FILE_NAME).read_text().splitlines()
    assert re.match(
        r"4 tests in \d+ s \(exit 1\); the tests. own [\d.]+ s, cpu [\d.]+ s; slowest", head
    ), head
    parsed = [re.match(r"\s*([\d.]+) s  cpu\s+([\d.]+) s  (\w+)\s+\S+::(\w+)$", r) for r in rows]
    assert all(parsed), rows
    seconds = [float(m[1]) for m in parsed]
    assert seconds == sorted(seconds, reverse=True)
    by_name = {m[4]: (float(m[1]), float(m[2]), m[3]) for m in parsed}
    assert by_name["test_sleeps"][0] >= 0.6 and by_name["test_sleeps"][1] < 0.3  # it waited
    assert by_name["test_computes_in_a_subprocess"][1] > 0.1  # the child's CPU counts
    assert by_name["test_fails"][2] == "failed" and by_name["test_quick"][2] == "passed"
