"""One log file as bytes, searched the cheap way.

A rank log can hold millions of lines; running a regex on each would take seconds per file. Here
the whole file is one `bytes` object and every search is `bytes.find`/`rfind` for a literal
(memchr speed); only the few lines that contain it are decoded and parsed. A record line starts
with the 23-character timestamp followed by ` | ` (RECORD_FORMAT); anything else (a traceback,
a stack dump, a STALL report body, faulthandler output) is a continuation line.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

from ae.log_lines import RECORD_PATTERN

_TIME_LEN = len("2026-11-21 22:15:38.039")
_SEP = b" | "
_TIME_FORMAT = "%Y-%m-%d %H:%M:%S.%f"


@dataclass(frozen=True)
class Evidence:
    """A line of a file, for the verdict: `debug_rank1_<TS>.log:123  <text>`."""

    path: Path
    line: int
    text: str


@dataclass(frozen=True)
class Record:
    """A parsed record line: `time` in Unix seconds (log times are the writer's local time)."""

    time: float
    level: str
    rank: int
    world: int
    worker: str | None
    message: str
    evidence: Evidence


def level_needle(level: str) -> bytes:
    """What RECORD_FORMAT puts around a level: ` | ERROR    | `."""
    return f" | {level:<8} | ".encode()


def message_needle(prefix: str) -> bytes:
    """A message prefix as it appears after the `[Rank r/W]` tag: what `find_records` seeks."""
    return b"] " + prefix.encode()


def parse_time(text: str) -> float:
    return datetime.strptime(text, _TIME_FORMAT).timestamp()


class LogBytes:
    def __init__(self, path: Path, data: bytes) -> None:
        self.path = path
        self.data = data
        self._counted = (0, 1)  # (offset, line number at offset): line numbers count forward
        self.clock_offset = 0.0  # the writer's clock against rank 0's: subtracted from times

    @classmethod
    def read(cls, path: Path) -> LogBytes:
        return cls(path, path.read_bytes())

    # --- lines ------------------------------------------------------------------------------
    def line_start(self, pos: int) -> int:
        return self.data.rfind(b"\n", 0, pos) + 1

    def line_end(self, start: int) -> int:
        end = self.data.find(b"\n", start)
        return len(self.data) if end < 0 else end

    def text(self, start: int) -> str:
        return self.data[start : self.line_end(start)].decode("utf-8", "replace")

    def lineno(self, start: int) -> int:
        """1-based line number of the line at `start`; cheap for increasing offsets."""
        pos, n = self._counted
        if start < pos:
            pos, n = 0, 1
        n += self.data.count(b"\n", pos, start)
        self._counted = (start, n)
        return n

    def evidence(self, start: int) -> Evidence:
        return Evidence(self.path, self.lineno(start), self.text(start))

    def is_record(self, start: int) -> bool:
        d = self.data
        return (
            d[start + _TIME_LEN : start + _TIME_LEN + 3] == _SEP and d[start : start + 4].isdigit()
        )

    def record(self, start: int) -> Record | None:
        ev = self.evidence(start)
        m = RECORD_PATTERN.match(ev.text)
        if m is None:
            return None
        return Record(
            parse_time(m["time"]) - self.clock_offset, m["level"], int(m["rank"]),
            int(m["world"]), m["worker"], m["message"], ev,
        )  # fmt: skip

    # --- searching --------------------------------------------------------------------------
    def find_records(self, needle: bytes, start: int = 0) -> Iterator[int]:
        """Start offsets of the record lines that contain `needle`, in file order."""
        d = self.data
        pos = d.find(needle, start)
        while pos >= 0:
            line = self.line_start(pos)
            end = self.line_end(line)
            if self.is_record(line):
                yield line
            pos = d.find(needle, end)

    def rfind_record(self, needle: bytes, end: int | None = None) -> int | None:
        """Start offset of the last record line that contains `needle`."""
        d = self.data
        pos = d.rfind(needle, 0, len(d) if end is None else end)
        while pos >= 0:
            line = self.line_start(pos)
            if self.is_record(line):
                return line
            pos = d.rfind(needle, 0, line)
        return None

    def count_level(self, level: str) -> int:
        """Record lines of this level: the needle sits right after the timestamp."""
        needle, d, n = level_needle(level), self.data, 0
        pos = d.find(needle)
        while pos >= 0:
            if pos == _TIME_LEN or (pos > _TIME_LEN and d[pos - _TIME_LEN - 1] == 0x0A):
                n += 1
            pos = d.find(needle, pos + len(needle))
        return n

    def level_records(self, level: str) -> Iterator[int]:
        needle = level_needle(level)
        for start in self.find_records(needle):
            if self.data.startswith(needle, start + _TIME_LEN):
                yield start

    def last_level_record(self, level: str) -> int | None:
        needle, end = level_needle(level), None
        while (start := self.rfind_record(needle, end)) is not None:
            if self.data.startswith(needle, start + _TIME_LEN):
                return start
            end = start
        return None

    def last_record(self) -> int | None:
        """Start of the last record line (continuation lines after it are skipped)."""
        d = self.data
        end = len(d) - 1 if d.endswith(b"\n") else len(d)  # end of the current line
        while end >= 0:
            start = d.rfind(b"\n", 0, end) + 1
            if self.is_record(start):
                return start
            end = start - 1
        return None

    def continuation(self, start: int, limit: int) -> Iterator[int]:
        """Starts of the continuation lines after the record at `start` (at most `limit`)."""
        pos = self.line_end(start) + 1
        d = self.data
        while limit > 0 and pos < len(d) and not self.is_record(pos):
            yield pos
            pos = self.line_end(pos) + 1
            limit -= 1

    def tail(self, n: int) -> list[Evidence]:
        """The last `n` lines of the file."""
        d = self.data
        end = len(d) - 1 if d.endswith(b"\n") else len(d)
        starts: list[int] = []
        while d and end >= 0 and len(starts) < n:
            start = d.rfind(b"\n", 0, end) + 1
            starts.append(start)
            end = start - 1
        return [self.evidence(s) for s in reversed(starts)]
