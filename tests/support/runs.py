"""Running the real launcher as a subprocess, and finding every process of a run."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest

ROOT = Path(__file__).resolve().parents[2]

# Tests that must not run beside one another under pytest-xdist (./run_tests.sh): timing bounds
# (a stall within --stall_timeout, a live answer within 5 s, a straggler named within its window)
# that several such runs at once on 2 cores would break. One group: one worker runs them one
# after another, beside the other workers' tests.
# Tests that share one launch (tests/e2e/conftest.py) are in it too, so that their session
# fixture runs once.
SERIAL = pytest.mark.xdist_group("serial")
# The two-host tests (network namespaces, bench/two_hosts.py) and the SLURM tests (the
# one-node cluster): one at a time within each group, each group beside the others -- they mostly
# wait on their timeouts, and one long chain of every such test was the suite's critical path.
TWO_HOSTS = pytest.mark.xdist_group("two_hosts")
SLURM = pytest.mark.xdist_group("slurm")
# The machine limits made real (a small /dev/shm, a full tmpfs, a memory cgroup,
# tests/e2e/test_resources.py): each in a private mount namespace, so they disturb no other test,
# but one at a time; a group of their own, off the serial group's long chain.
LIMITS = pytest.mark.xdist_group("limits")


def shared_launches(module: str) -> pytest.MarkDecorator:
    """The mark of a test module whose tests share its launches (a module-scoped fixture): one
    group, so that one worker runs them all and launches once. pytest-xdist sets a module
    fixture up once per worker that draws one of its tests: test_position's four launches ran
    three times over (~120 s of CPU) before. tests/test_suite_timing.py holds every such module
    to it."""
    return pytest.mark.xdist_group(module)


@dataclass
class RunResult:
    returncode: int
    output: str
    logs: Path

    def log(self, pattern: str) -> list[Path]:
        return sorted(self.logs.glob(pattern))

    def text(self, pattern: str) -> str:
        return "".join(p.read_text() for p in self.log(pattern))


def run_launcher(
    args: list[str], out_dir: Path, env: dict[str, str] | None = None, timeout: float = 240
) -> RunResult:
    """Run the real launcher (`python -m ae.cli.launch`, what ./train_ae.sh execs) to completion."""
    base = {k: v for k, v in os.environ.items() if k not in ("AE_RUN_TS", "MASTER_PORT")}
    full_env = {**base, "AE_CACHE_DIR": str(out_dir.parent / "cache"), **(env or {})}
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "ae.cli.launch", f"--output_dir={out_dir}", *args],
            cwd=ROOT,
            env=full_env,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
    except subprocess.TimeoutExpired as e:
        pytest.fail(_hung_run(out_dir, e), pytrace=False)
    return RunResult(proc.returncode, proc.stdout + proc.stderr, out_dir / "logs")


def _hung_run(out_dir: Path, e: subprocess.TimeoutExpired) -> str:
    """What a run that outlived its test says about itself (ae-diagnose on its logs, then the
    console's tail); its processes are killed so that they do not slow the tests after it."""
    diagnosis = subprocess.run(
        [sys.executable, "-m", "ae.diagnose", str(out_dir / "logs"), "--tail=5"],
        cwd=ROOT, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    for proc in run_processes(out_dir):
        with contextlib.suppress(psutil.Error):
            proc.kill()
    console = e.stderr.decode(errors="replace") if isinstance(e.stderr, bytes) else e.stderr or ""
    return (
        f"the run did not end within {e.timeout:.0f} s\n--- ae-diagnose ---\n"
        f"{diagnosis.stdout}{diagnosis.stderr}\n--- console (tail) ---\n{console[-3000:]}"
    )


def run_processes(out_dir: Path) -> list[psutil.Process]:
    """Every process of a run (launcher, torchrun, ranks, dataloader workers): their command
    lines name its output dir. Ranks run in sessions of their own, out of the launcher's group."""
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        if any(str(out_dir) in arg for arg in proc.info["cmdline"] or []):
            found.append(proc)
    return found


def processes_left(out_dir: Path, grace_s: float = 15) -> list[list[str]]:
    """The command lines of a run's processes still alive after `grace_s` (none, once it ended
    cleanly: dataloader workers of a SIGKILLed rank notice their parent is gone within seconds)."""
    end = time.monotonic() + grace_s
    while (left := run_processes(out_dir)) and time.monotonic() < end:
        time.sleep(0.5)
    found = []
    for proc in left:
        with contextlib.suppress(psutil.Error):
            found.append(proc.cmdline())
    return found
