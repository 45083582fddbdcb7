"""A live run of the real launcher, for tests that watch a job while it runs (and then kill it)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psutil

from tests.support.runs import ROOT, run_processes


@contextlib.contextmanager
def live_run(
    args: list[str], out: Path, fault: str = "", console: Path | None = None
) -> Iterator[subprocess.Popen[bytes]]:
    """Start the launcher in a session of its own (its output into `console`, if given); on
    leaving, kill every process of the run."""
    env = {k: v for k, v in os.environ.items() if k not in ("AE_RUN_TS", "MASTER_PORT")}
    env.update(AE_CACHE_DIR=str(out.parent / "cache"), AE_FAULT=fault)
    sink = console.open("wb") if console is not None else subprocess.DEVNULL
    proc = subprocess.Popen(
        [sys.executable, "-m", "ae.cli.launch", f"--output_dir={out}", *args],
        cwd=ROOT, env=env, stdout=sink, stderr=subprocess.STDOUT, start_new_session=True,
    )  # fmt: skip
    if console is not None:
        sink.close()  # the launcher holds its own copy
    try:
        yield proc
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        for p in run_processes(out):
            with contextlib.suppress(psutil.Error):
                p.kill()
        proc.wait(timeout=30)


def wait_for(what: str, check: Callable[[], Any], timeout: float = 120) -> Any:
    """Poll `check` until it returns something true; return that."""
    end = time.monotonic() + timeout
    while not (found := check()):
        assert time.monotonic() < end, f"timed out waiting for {what}"
        time.sleep(0.5)
    return found


def diagnose(logs: Path, *flags: str) -> str:
    res = subprocess.run(
        [sys.executable, "-m", "ae.diagnose", str(logs), *flags],
        cwd=ROOT, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr
    return res.stdout


def diagnose_json(logs: Path) -> dict[str, Any]:
    return json.loads(diagnose(logs, "--json"))
