"""`ae-diagnose`: which rank holds a job back, from the files of a live or dead run.

Modules, one concern each: `run_files` (which files make a run), `logscan` (fast byte-level
search of a log), `heartbeats`, `phases`, `rank_log` (one rank's state), `run_state` (all of
them, the time frame), `verdict` (the rules naming culprits), `report` (JSON and rich table),
`watch` (live view of the heartbeats), `bundle` (tarball for a bug report), `cli`.
"""

from __future__ import annotations

from typing import Any

from ae.diagnose.report import to_json
from ae.diagnose.run_files import RunFiles
from ae.diagnose.run_state import read_run
from ae.diagnose.verdict import judge


def diagnose(files: RunFiles, tail: int = 0) -> dict[str, Any]:
    """The diagnosis of a run as the `--json` object."""
    run = read_run(files)
    return to_json(run, judge(run), tail)
