"""bench/lockstep.py, the turns that trainer_overhead's sides take: slices never overlap and go
round in order, no side ends before every side's window is over, and a side that dies ends the
round with its error instead of hanging it; each for sides started as new interpreters (argv) and
as forks of the coordinator's process (a function: `--quick`'s way)."""

from __future__ import annotations

import functools
import os
import sys
from pathlib import Path

import pytest

from bench.lockstep import Command, run_in_turns
from tests.support.runs import ROOT

# A side: its first turn after `start`, then `slices` slices, each written down with its order.
SIDE = """
import sys, time
from bench.lockstep import Turns
name, log, slices = sys.argv[1], open(sys.argv[2], "w"), int(sys.argv[3])
turns = Turns(name)
turns.wait()
for i in range(slices):
    log.write(f"{time.monotonic_ns()} {name} {i}\\n")
    log.flush()
    if name == "dies" and i == 1:
        sys.exit("this side fails in its second slice")
    time.sleep(0.005)
    turns.wait(last=i == slices - 1)
log.write(f"{time.monotonic_ns()} {name} end\\n")
"""


def _forked_side(*argv: str) -> int:
    """SIDE, run in a fork of this process."""
    sys.argv = ["side", *argv]
    exec(SIDE, {})
    return 0


def _run(
    tmp_path: Path, names: list[str], forked: bool, slices: int = 4
) -> tuple[dict, list[list[str]]]:
    commands: dict[str, tuple[Command, int]] = {}
    for name in names:
        argv = [name, str(tmp_path / f"{name}.log"), str(slices)]
        start = (
            functools.partial(_forked_side, *argv)
            if forked
            else [sys.executable, "-c", SIDE, *argv]
        )
        commands[name] = (start, 1)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    results = run_in_turns(commands, env, timeout=60)
    events = sorted(
        line.split()
        for name in names
        for line in (tmp_path / f"{name}.log").read_text().split("\n")
        if line
    )
    return results, [e[1:] for e in events]


FORKED = pytest.mark.parametrize("forked", [False, True], ids=["argv", "forked"])


@FORKED
def test_sides_take_turns_in_order_and_end_together(tmp_path: Path, forked: bool) -> None:
    results, events = _run(tmp_path, ["a", "b", "c"], forked)
    assert all(r.returncode == 0 for r in results.values()), results
    slices = [e for e in events if e[1] != "end"]
    assert slices == [[name, str(i)] for i in range(4) for name in ("a", "b", "c")]
    assert [e[1] for e in events[-3:]] == ["end"] * 3  # every teardown after every window


@FORKED
def test_a_side_that_dies_ends_the_round_with_its_error(tmp_path: Path, forked: bool) -> None:
    results, _ = _run(tmp_path, ["a", "dies"], forked)
    assert results["dies"].returncode != 0
    assert "this side fails in its second slice" in results["dies"].stderr
    assert results["a"].returncode != 0  # killed, not left waiting for its turn
    assert "the round ended" in results["a"].stderr
