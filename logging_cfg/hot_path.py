"""The per-batch DEBUG line, written without loguru's generic path.

With --debug, every training and validation batch logs a line. Through `logger.debug` that
costs ~100 us in a training loop (record dict, patcher, each handler's filter, loguru's Python
time formatting, all with cold caches), several percent of a small model's step. A DEBUG record
only ever goes to the rank's debug log, so `debug_line` formats the very line loguru would write
(RECORD_FORMAT) and appends it to that file in one write: ~10x cheaper, same durability.
"""

from __future__ import annotations

import time

from logging_cfg.rank_context import rank_tag
from logging_cfg.sinks import AppendFileSink

_sink: AppendFileSink | None = None  # the debug log when DEBUG is on, else None
_second = (-1, "")  # (Unix second, its `YYYY-mm-dd HH:MM:SS`): localtime() is not cheap


def install(sink: AppendFileSink | None) -> None:
    global _sink
    _sink = sink


def format_line(level: str, message: str, when: float) -> str:
    """RECORD_FORMAT: `2026-11-21 22:15:38.039 | DEBUG    | [Rank 1/2] message` + newline."""
    global _second
    second = int(when)
    if second != _second[0]:
        _second = (second, time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(second)))
    ms = int(when * 1000) % 1000
    return f"{_second[1]}.{ms:03d} | {level: <8} | {rank_tag()} {message}\n"


def debug_line(message: str) -> None:
    """`logger.debug(message)` for per-batch lines; nothing when DEBUG is off."""
    if _sink is not None:
        _sink.write(format_line("DEBUG", message, time.time()))
