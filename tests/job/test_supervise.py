"""The launcher's wait on its child: stop signals passed on, and what the console says."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading

import pytest

from ae.job.supervise import wait


@pytest.mark.parametrize(
    ("on_stop", "line"),
    [
        (None, "SIGTERM: every rank saves a checkpoint at its next step, then stops"),
        # ae-encode's ranks save nothing: they said they would save a checkpoint
        ("every rank stops now; the output shards it finished stay in place",
         "SIGTERM: every rank stops now; the output shards it finished stay in place"),
    ],
)  # fmt: skip
def test_a_stop_is_passed_on_and_said_as_the_job_does_it(
    on_stop: str | None, line: str, said: list[str]
) -> None:
    # A child that takes its time to stop, as torchrun does (the console speaks meanwhile)
    code = (
        "import signal, sys, time\n"
        "signal.signal(signal.SIGTERM, lambda *a: (time.sleep(0.5), sys.exit(7)))\n"
        "print('ready', flush=True)\n"
        "time.sleep(30)\n"
    )
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert child.stdout is not None and child.stdout.readline() == "ready\n"
    threading.Timer(0.1, os.kill, (os.getpid(), signal.SIGTERM)).start()
    rc, stops = wait(child, on_stop=on_stop)
    assert stops.first == signal.SIGTERM and rc == 7  # passed on
    assert said == [line]
