"""Log record and file-name formats, shared by the writers (logging_cfg, ae) and the reader
(`ae-diagnose`). This module imports nothing from `ae`: `ae.log_lines` builds on it.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass, field
from typing import Any

# Every record line: `2026-11-21 22:15:38.039 | INFO     | [Rank 1/2 Worker 0/2] message`.
# RECORD_FORMAT is the loguru format the sinks use; RECORD_PATTERN reads such lines back.
RECORD_FORMAT = "{time:YYYY-MM-DD HH:mm:ss.SSS} | {level: <8} | {extra[tag]} {message}"
RECORD_PATTERN = re.compile(
    r"^(?P<time>\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d{3}) \| (?P<level>[A-Z]+)\s*\| "
    r"\[Rank (?P<rank>\d+)/(?P<world>\d+)(?: Worker (?P<worker>\d+)/(?P<workers>\d+))?\] "
    r"(?P<message>.*)$"
)

_FIELD_PATTERNS = {
    "int": r"-?\d+",
    "float": r"[-+]?(?:\d+\.?\d*(?:[eE][-+]?\d+)?|nan|inf)",
    "word": r"\S+",
    "text": r".*?",
}


@dataclass(frozen=True)
class LineFormat:
    """A message template like `Training step {step}, loss={loss}` with typed fields."""

    template: str
    types: dict[str, str] = field(default_factory=dict)

    def format(self, **values: Any) -> str:
        return self.template.format(**values)

    @functools.cached_property
    def regex(self) -> re.Pattern[str]:
        parts = re.split(r"\{(\w+)(?::[^}]*)?\}", self.template)
        out = []
        for i, part in enumerate(parts):
            if i % 2 == 0:
                out.append(re.escape(part))
                continue
            pattern = _FIELD_PATTERNS[self.types.get(part, "word")]
            if pattern == _FIELD_PATTERNS["text"] and i == len(parts) - 2 and not parts[-1]:
                pattern = ".*"  # a text field that ends the line takes the rest of it
            out.append(f"(?P<{part}>{pattern})")
        return re.compile("".join(out))

    def parse(self, line: str) -> dict[str, str] | None:
        m = self.regex.search(line)
        return None if m is None else m.groupdict()

    @functools.cached_property
    def prefix(self) -> str:
        """The literal text before the first field: a cheap substring test before `.parse()`."""
        return self.template.split("{", 1)[0]


# Uncaught exception, CRITICAL, traceback on the following lines. `where`: `main thread`,
# `thread <name>`, or `dataloader worker <w>/<K>`.
FATAL = LineFormat(
    "FATAL uncaught exception {exc_type} in {where}: {message}",
    {"exc_type": "word", "where": "text", "message": "text"},
)
# A dataloader worker whose rank process is gone (SIGKILL, the OOM killer): its sockets to the
# rank reset, and that is no failure of its own. INFO, once, then the worker leaves.
WORKER_ORPHANED = LineFormat("parent rank gone, worker exiting")
# Files of a run in the logs folder (rotated ones get `.1`, `.2` ... appended).
TRAIN_LOG_FILE = LineFormat("train_{ts}.log")
DEBUG_LOG_FILE = LineFormat("debug_rank{rank}_{ts}.log", {"rank": "int"})
NATIVE_LOG_FILE = LineFormat("native_rank{rank}_{ts}.log", {"rank": "int"})
# torchrun's own output (its agent's lines, its failure report) on the launcher's node.
LAUNCHER_LOG_FILE = LineFormat("launcher_{ts}.log")
# Heartbeat file per rank in the logs folder (its fields: ae.log_lines.HEARTBEAT_FIELDS).
HEARTBEAT_FILE = LineFormat("heartbeat_rank{rank}_{ts}.json", {"rank": "int"})
