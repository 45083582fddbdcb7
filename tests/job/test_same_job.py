"""A node's note to the other nodes' launchers (ae/job/same_job.py): read from another host, it
is there whole or not at all."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from ae.job.peer_nodes import PeerNodes
from ae.job.same_job import tell_leader
from ae.run_paths import RunDir
from bench.synthetic_logs import TS
from tests.support.runs import ROOT

# Node 1's launcher, its file size limited (RLIMIT_FSIZE) below its note: the write fails with
# EFBIG midway, as on a full disk.
_WRITE_CUT_SHORT = """
import resource, signal, sys
from pathlib import Path
from ae.job.same_job import tell_leader
from ae.run_paths import RunDir
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, (1024, 1024))
print(tell_leader(RunDir(Path(sys.argv[1])), sys.argv[2], 1, "x" * 4096, failed=sys.argv[3] == "1"))
"""


def test_a_note_cut_short_is_never_seen_half_written(tmp_path: Path) -> None:
    """Was: `Path.write_text` wrote the note in place; a write cut short left node 0's launcher
    a truncated JSON file, and one read while written half of it."""
    for failed in (False, True):
        res = subprocess.run(
            [sys.executable, "-c", _WRITE_CUT_SHORT, str(tmp_path), TS, str(int(failed))],
            capture_output=True, text=True, timeout=60, cwd=ROOT,
        )  # fmt: skip
        assert res.stdout.strip() == "False", res.stdout + res.stderr
        assert sorted(p.name for p in tmp_path.iterdir()) == []  # nothing, not half a note


def test_a_failed_note_is_read_whole(tmp_path: Path) -> None:
    run_dir = RunDir(tmp_path)
    assert tell_leader(run_dir, TS, 1, "rank 1 on node1: ...", failed=True)
    note = json.loads(run_dir.failed(1).read_text())
    assert (note["run_ts"], note["node"], note["message"]) == (TS, 1, "rank 1 on node1: ...")
    assert PeerNodes(tmp_path / "logs", TS).refused() is None  # not a refusal to join
