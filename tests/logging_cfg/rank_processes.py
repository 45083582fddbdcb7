"""`run_rank`: a real Python process that configures logging_cfg as rank `rank` of 2 does
(`PREAMBLE`, log files named with the run TS `TS`), then runs a test's body."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

from tests.support.runs import ROOT

PREAMBLE = """
import os, signal, sys, threading, time
from pathlib import Path
import logging_cfg
from loguru import logger
ctx = logging_cfg.RankContext(rank={rank}, world_size=2)
paths = logging_cfg.configure(Path({logs!r}), "TS", ctx, **{kwargs!r})
"""


def run_rank(
    logs: Path, body: str, rank: int = 1, env: dict[str, str] | None = None, **kwargs: object
) -> subprocess.CompletedProcess:
    code = PREAMBLE.format(rank=rank, logs=str(logs), kwargs=kwargs) + textwrap.dedent(body)
    return subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        env={**os.environ, **(env or {})},
        capture_output=True,
        text=True,
        timeout=120,
    )
