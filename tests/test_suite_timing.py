"""The suite reports its own slowest tests: tests.support.durations writes them, slowest first,
to `.pytest_durations.txt` in the rootdir, also when a test fails (what .ci/run prints); and a
launch that several tests share runs once under pytest-xdist."""

from __future__ import annotations

import ast
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


# What puts a test on one worker with the others of its kind (tests/support/runs.py).
GROUP_MARKS = ("xdist_group", "shared_launches", "SERIAL", "TWO_HOSTS", "SLURM", "LIMITS")


def _launching_functions(tree: ast.Module) -> tuple[dict[str, ast.FunctionDef], set[str]]:
    """A module's top-level functions, and those that launch a run: they call `run_launcher` or
    name `ae.cli.launch`, themselves or through another of the module's functions."""
    functions = {n.name: n for n in tree.body if isinstance(n, ast.FunctionDef)}
    direct, calls = set(), {}
    for name, fn in functions.items():
        calls[name] = set()
        for node in ast.walk(fn):
            if isinstance(node, ast.Constant) and node.value == "ae.cli.launch":
                direct.add(name)
            if isinstance(node, ast.Call):
                callee = node.func
                called = getattr(callee, "id", None) or getattr(callee, "attr", None)
                if called == "run_launcher":
                    direct.add(name)
                elif called in functions:
                    calls[name].add(called)
    launching = set(direct)
    while grown := {n for n, c in calls.items() if n not in launching and c & launching}:
        launching |= grown
    return functions, launching


def _scope(fn: ast.FunctionDef) -> str | None:
    for deco in fn.decorator_list:
        if isinstance(deco, ast.Call) and ast.unparse(deco.func).endswith("fixture"):
            for kw in deco.keywords:
                if kw.arg == "scope" and isinstance(kw.value, ast.Constant):
                    return kw.value.value
    return None


def _module_mark(tree: ast.Module) -> str:
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(
            getattr(t, "id", None) == "pytestmark" for t in node.targets
        ):
            return ast.unparse(node.value)
    return ""


def test_every_test_of_a_shared_launch_is_in_a_group() -> None:
    """A module- or session-scoped fixture that launches runs once per pytest-xdist worker that
    draws one of its tests: its tests must all be in one xdist_group."""
    modules = {p: ast.parse(p.read_text()) for p in sorted((ROOT / "tests").rglob("*.py"))}
    shared: dict[str, Path] = {}  # fixture name -> where it is defined
    for path, tree in modules.items():
        functions, launching = _launching_functions(tree)
        shared |= {n: path for n in launching if _scope(functions[n]) in ("module", "session")}
    assert {"runs", "stopped", "rank_1_raises_at_step_3"} <= set(shared)  # the scan finds them
    loose = []
    for path, tree in modules.items():
        module_mark = _module_mark(tree)
        for fn in (n for n in tree.body if isinstance(n, ast.FunctionDef)):
            uses = [a.arg for a in fn.args.args if a.arg in shared]
            uses = [u for u in uses if shared[u] == path or shared[u].name == "conftest.py"]
            marks = module_mark + " ".join(ast.unparse(d) for d in fn.decorator_list)
            if fn.name.startswith("test_") and uses and not any(m in marks for m in GROUP_MARKS):
                loose.append(f"{path.relative_to(ROOT)}::{fn.name} uses {', '.join(uses)}")
    assert not loose, (
        "tests of a shared launch outside any xdist_group (each worker that draws one launches "
        "again; mark the module with tests.support.runs.shared_launches(__name__)):\n"
        + "\n".join(loose)
    )
