"""A real SLURM for the tests: the one that answers here, or a one-node cluster started by
`slurm_cluster.sh` (slurmctld + slurmd on localhost; slurm-wlm and munge must be installed:
`slurm_cluster.sh install` does it with apt-get, as .ci/run does)."""

from __future__ import annotations

import re
import shutil
import subprocess
import time
from pathlib import Path

SCRIPT = Path(__file__).with_name("slurm_cluster.sh")
START_TIMEOUT_S = 60  # it starts in about 5 s
# A job in these states has yet to end (REQUEUED: it starts again).
NOT_ENDED = ("PENDING", "CONFIGURING", "RUNNING", "COMPLETING", "REQUEUED")


def sinfo_answers() -> bool:
    """A controller answers and has a usable node."""
    if shutil.which("sinfo") is None:
        return False
    try:
        out = subprocess.run(
            ["sinfo", "-h", "-N", "-o", "%T"], capture_output=True, text=True, timeout=15
        )
    except subprocess.TimeoutExpired:
        return False
    return out.returncode == 0 and bool(re.search(r"idle|mixed|allocated", out.stdout))


def start_cluster() -> str | None:
    """Start the one-node cluster; None when it answers, else why not."""
    try:
        out = subprocess.run(
            ["bash", str(SCRIPT), "start"], capture_output=True, text=True, timeout=START_TIMEOUT_S
        )
    except subprocess.TimeoutExpired:
        return f"{SCRIPT.name} start did not finish within {START_TIMEOUT_S}s"
    if out.returncode != 0 or not sinfo_answers():
        tail = "\n".join((out.stdout + out.stderr).strip().splitlines()[-8:])
        return f"{SCRIPT.name} start failed (exit {out.returncode}):\n{tail}"
    return None


def stop_cluster() -> None:
    subprocess.run(["bash", str(SCRIPT), "stop"], capture_output=True, timeout=120)


def job_state(job_id: str) -> str:
    out = subprocess.run(
        ["scontrol", "show", "job", job_id], capture_output=True, text=True, timeout=30
    )
    m = re.search(r"JobState=(\S+)", out.stdout)
    return m[1] if m else "UNKNOWN"


def wait_for_job_end(job_id: str, timeout: float = 180) -> str:
    end = time.monotonic() + timeout
    while (state := job_state(job_id)) in NOT_ENDED:
        assert time.monotonic() < end, f"job {job_id} still {state} after {timeout}s"
        time.sleep(0.5)
    return state
