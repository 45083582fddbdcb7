"""Runs with a machine limit made real: a bash script in a private mount namespace (`unshare -m`),
where it mounts a small tmpfs over /dev/shm or an output folder; a memory-limited cgroup."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.runs import ROOT

CGROUP = Path("/sys/fs/cgroup")


def namespace_problem() -> str | None:
    """Why a private mount namespace with a tmpfs cannot be made here, or None."""
    if shutil.which("unshare") is None:
        return "no unshare"
    probe = subprocess.run(
        ["unshare", "-m", "sh", "-c", "mount -t tmpfs -o size=1m tmpfs /mnt"],
        capture_output=True, text=True,
    )  # fmt: skip
    return None if probe.returncode == 0 else f"unshare -m + mount refused: {probe.stderr.strip()}"


def in_namespace(script: str, out_dir: Path, timeout: float = 240) -> subprocess.CompletedProcess:
    """`script` under `bash -eu` in a private mount namespace, in the repo, with `$PY` the test's
    python and `$LAUNCH` the launcher (what ./train_ae.sh execs); its mounts vanish with it."""
    if (problem := namespace_problem()) is not None:
        pytest.skip(problem)
    env = {k: v for k, v in os.environ.items() if k not in ("AE_RUN_TS", "MASTER_PORT")}
    env.update(PY=sys.executable, LAUNCH=f"{sys.executable} -m ae.cli.launch",
               AE_CACHE_DIR=str(out_dir.parent / "cache"))  # fmt: skip
    return subprocess.run(
        ["unshare", "-m", "bash", "-euc", script],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout,
    )  # fmt: skip


def memory_cgroup() -> tuple[Path, str] | None:
    """A folder under which a memory-limited child cgroup can be made (and its version), or None:
    cgroup v2 with the memory controller delegated, or v1's memory hierarchy, writable."""
    own = {}
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        hid, controllers, rel = line.split(":", 2)
        own["v2" if hid == "0" and not controllers else controllers] = rel.lstrip("/")
    candidates = []
    if "v2" in own:
        candidates.append((CGROUP / own["v2"], "v2"))
    for controllers, rel in own.items():
        if "memory" in controllers.split(","):
            candidates.append((CGROUP / "memory" / rel, "v1"))
    for parent, version in candidates:
        probe = parent / f"ae_probe_{os.getpid()}"
        try:
            probe.mkdir()
        except OSError:
            continue
        limit = probe / ("memory.max" if version == "v2" else "memory.limit_in_bytes")
        ok = limit.exists()
        probe.rmdir()
        if ok:
            return parent, version
    return None
