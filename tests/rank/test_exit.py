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


# A user's model failing in its own code: the message names the line, the console has no
# traceback, and the rank's debug log keeps the whole of it (it was lost).
USER_ERROR_WITH_A_CAUSE = """
import sys
from pathlib import Path
import logging_cfg
from ae.rank.exit import run_to_exit
from ae.training.models import ModelError

def deep_in_the_users_net():
    raise ValueError("the real cause")

def work():
    try:
        deep_in_the_users_net()
    except ValueError as e:
        raise ModelError("model: its forward fails") from e

logging_cfg.configure(Path(sys.argv[1]), "TS", logging_cfg.RankContext())
sys.exit(run_to_exit(work))
"""


def test_a_user_errors_cause_is_in_the_debug_log_not_on_the_console(tmp_path) -> None:
    res = subprocess.run(
        [sys.executable, "-c", USER_ERROR_WITH_A_CAUSE, str(tmp_path)], cwd=ROOT,
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert res.returncode == 2, res.stderr[-2000:]
    console = res.stdout + res.stderr
    assert "model: its forward fails" in console and "Traceback" not in console
    debug = (tmp_path / "debug_rank0_TS.log").read_text()
    assert "ModelError came from:" in debug
    assert "in deep_in_the_users_net" in debug and "ValueError: the real cause" in debug
    assert "Traceback" not in (tmp_path / "train_TS.log").read_text()
