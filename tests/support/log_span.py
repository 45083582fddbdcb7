"""The wall time a job's logs span, read the plain way (every record line of every train and
debug log in the folder, first to last), to check `ae-diagnose --goodput` against."""

from __future__ import annotations

import re
from datetime import datetime
from pathlib import Path

_TIME = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d{3}) \| ")


def log_span(logs: Path) -> float:
    """Seconds from the first record to the last, over train_*.log and debug_rank*.log."""
    times = []
    for path in [*logs.glob("train_*.log*"), *logs.glob("debug_rank*.log*")]:
        for line in path.read_text(errors="replace").splitlines():
            if m := _TIME.match(line):
                times.append(datetime.strptime(m[1], "%Y-%m-%d %H:%M:%S.%f"))
    return (max(times) - min(times)).total_seconds()
