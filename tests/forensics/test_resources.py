"""The resource readers of the heartbeat and the preflight, and the watchdog's note on a full
/dev/shm (in a private mount namespace with a small, filled tmpfs over /dev/shm)."""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from ae.forensics.resources import ResourceReader, open_fds
from ae.log_lines import RESOURCE_FIELDS, SHM_NEAR_FULL
from tests.support.limits import namespace_problem
from tests.support.runs import ROOT


def test_sample_has_every_field_with_the_kernels_figures(tmp_path: Path) -> None:
    sample = ResourceReader(tmp_path).sample()
    assert tuple(sample) == RESOURCE_FIELDS
    st = os.statvfs(tmp_path)
    assert abs(sample["disk_total_mb"] - st.f_blocks * st.f_frsize / 2**20) < 1
    assert 0 < sample["mem_available_mb"] <= sample["mem_total_mb"]
    assert sample["fd_limit"] == resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    assert sample["oom_kills"] == sample["oom_kills_at_start"]  # nothing was killed meanwhile
    before = open_fds()
    with open(tmp_path / "f", "w"):
        assert open_fds() == before + 1


WATCHDOG = textwrap.dedent("""
    import json, sys, time
    from loguru import logger
    from ae.forensics.progress import Progress
    from ae.forensics.watchdog import Watchdog
    from logging_cfg import RankContext
    lines = []
    logger.remove()
    logger.add(lambda m: lines.append(str(m.record["message"])), level="DEBUG")
    prog = Progress()
    prog.enter("data loading", step=3)
    dog = Watchdog(0.3, RankContext(), None, progress=prog)
    dog.start()
    time.sleep(1.5)
    print(json.dumps(lines))
""")


def test_watchdog_names_a_full_shm_at_a_data_loading_stall(tmp_path: Path) -> None:
    """What a blocked worker looks like from its rank: no progress in data loading while
    /dev/shm is full (a 2 MB tmpfs, filled by a file as batches would fill it)."""
    if (problem := namespace_problem()) is not None:
        pytest.skip(problem)
    script = (
        "mount -t tmpfs -o size=2m tmpfs /dev/shm && "
        "fallocate -l 2M /dev/shm/batches || head -c 2000000 /dev/zero > /dev/shm/batches; "
        f'"{sys.executable}" -c "$WATCHDOG"'
    )
    res = subprocess.run(
        ["unshare", "-m", "bash", "-c", script], cwd=ROOT, capture_output=True, text=True,
        env={**os.environ, "WATCHDOG": WATCHDOG}, timeout=120,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr
    lines = json.loads(res.stdout.strip().splitlines()[-1])
    notes = [m for line in lines if (m := SHM_NEAR_FULL.parse(line))]
    assert len(notes) == 1, lines  # once per stall, not per report
    assert notes[0]["phase"] == "data loading" and float(notes[0]["total"]) == 2.0
    assert float(notes[0]["free"]) < 0.2 and "--shm-size" in notes[0]["fix"]
