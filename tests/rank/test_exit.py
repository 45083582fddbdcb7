"""How a rank process ends (`ae.rank.exit.run_to_exit`), in a process of its own: signals are
process-wide, and the case here ends in one."""

from __future__ import annotations

import subprocess
import sys

from tests.support.runs import ROOT

# A fit that failed, as Lightning leaves it: SIGTERM back at its default. Then torchrun's SIGTERM
# (a peer failed too) lands while the rank dumps its Flight Recorder.
FAILED_THEN_SIGTERMED = """
import os, signal
from ae.forensics import flight_recorder
from ae.rank.exit import run_to_exit

def dump(reason):
    os.kill(os.getpid(), signal.SIGTERM)
    print("dumped:", reason, flush=True)

def work():
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    raise RuntimeError("Connection closed by peer")

flight_recorder.dump = dump
run_to_exit(work)
"""


def test_a_sigterm_while_a_failed_rank_tears_down_does_not_cut_its_report() -> None:
    res = subprocess.run(
        [sys.executable, "-c", FAILED_THEN_SIGTERMED], cwd=ROOT, capture_output=True, text=True,
        timeout=120,
    )  # fmt: skip
    # Killed by the signal's default action, it would exit -15 with neither line below.
    assert res.returncode == 1, (res.returncode, res.stderr[-2000:])
    assert "dumped: failed: RuntimeError" in res.stdout
    assert "RuntimeError: Connection closed by peer" in res.stderr
