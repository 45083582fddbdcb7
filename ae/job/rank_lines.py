"""The console speaks for every rank: the launcher follows the train log while the job runs.

Only rank 0's process writes to the console itself (`logging_cfg`); every rank's warnings and
errors also go to `train_<TS>.log`, rank-tagged. A thread of the launcher reads what is new there
every `POLL_S` and puts on the console, tagged `rank R` (`rank R worker W`), what rank 0 could
not say: the ERROR records of the other ranks and of every dataloader worker (rank 0's
included), whole (a message's reason is often on its second line; past `RECORD_LINES` lines, the
first of them and where the rest is), each rank's `Data errors` summary, another node's
`Resource tight` lines (its local rank 0 reckons that node's limits), and the first STALL line
of each stall of the other ranks (the culprit's, not only the waiting rank 0's). Uncaught
exceptions stay off: the launcher prints the diagnosis of the whole job at the end. To keep the
console calm, each source shows at most `BURST` ERROR records per `WINDOW_S`; the rest are
counted, and the count is said when the window closes (and at the end). An ERROR record whose
message rank 0 also logged (a user error every rank finds alike), or that another rank already
said, is said once: the other ranks' ERROR records wait `HOLD_S` for rank 0's own before they
are shown. Not a NONFINITE line: it names the rank that wrote it, so rank 0 never writes the
same text, and it is said at once (a run that skips the step goes on, and may end before the
hold would: the line came after `Training finished`).
"""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from loguru import logger

from ae.log_lines import DATA_ERRORS, NONFINITE, RECORD_PATTERN, RESOURCE_TIGHT, STALL

# A line reaches the console at most this long after it is written: a run that goes on after
# an ERROR of another rank (a NONFINITE line under --on_nonfinite=skip) can end within a second.
POLL_S = 0.2
BURST = 3  # ERROR records shown per source and window
WINDOW_S = 60.0
# An ERROR of another rank waits this long for the same text from rank 0: a user error every
# rank finds (a preflight limit) reached rank 0 2.0 s after rank 1 on a loaded CI machine
HOLD_S = 5.0
# Lines of an ERROR record said on the console at most (a traceback can run to hundreds); the
# rest stays in the train log, which the console names.
RECORD_LINES = 10


@dataclass
class _Source:
    window_start: float = 0.0
    shown: int = 0
    held: int = 0  # ERROR records not shown in this window


@dataclass
class RankLines:
    """Reads the train log from where it stopped; `poll` says the new lines worth saying."""

    train_log: Path
    offset: int = 0
    partial: bytes = b""
    sources: dict[str, _Source] = field(default_factory=dict)
    stalls: dict[int, tuple[str, str, str]] = field(default_factory=dict)  # rank -> episode
    # ERROR messages on the console already, whole (a record with its continuation lines):
    # rank 0's own, and those said here (not those counted over a burst, nor those cut at
    # RECORD_LINES); the launcher's last words leave them out
    said: set[str] = field(default_factory=set)
    cut: set[str] = field(default_factory=set)  # said here, but only their first lines
    # Rank 0's ERROR messages read so far, and those of them this relay said lines after: held
    # lines (a worker's bad samples) come out after rank 0's stop message, which is then no
    # longer the console's last word, so the launcher's last words say it again.
    rank0: set[str] = field(default_factory=set)
    buried: set[str] = field(default_factory=set)
    held: list[tuple[float, str, str]] = field(default_factory=list)  # (due, who, message)

    def poll(self, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        for m, more in self._new_records():
            self._record(m, more, now)
        self._release(now)
        self._close_windows(now, final=False)

    def finish(self) -> None:
        self.poll()
        self._release(float("inf"))  # every line of the run is read: rank 0's too
        self._close_windows(time.monotonic(), final=True)

    def _release(self, now: float) -> None:
        due = [h for h in self.held if h[0] <= now]
        self.held = [h for h in self.held if h[0] > now]
        for _, who, message in due:
            self._say(who, message, now)

    def _say(self, who: str, message: str, now: float) -> None:
        if message in self.said or message in self.cut:
            return
        lines = message.split("\n")
        whole = len(lines) <= RECORD_LINES
        if not whole:
            rest = f"... {len(lines) - RECORD_LINES} more lines in {self.train_log.name}"
            lines = [*lines[:RECORD_LINES], rest]
        if self._error(who, "\n".join(lines), now):
            (self.said if whole else self.cut).add(message)

    def _new_lines(self) -> list[str]:
        try:
            with self.train_log.open("rb") as f:
                f.seek(self.offset)
                data = f.read()
        except OSError:
            return []
        self.offset += len(data)
        *lines, self.partial = (self.partial + data).split(b"\n")
        return [raw.decode("utf-8", "replace") for raw in lines]

    def _new_records(self) -> list[tuple[re.Match[str], list[str]]]:
        """The new records, each with its continuation lines (a message of several lines, a
        traceback). A record is one write (logging_cfg's AppendFileSink), so a poll reads it
        whole; a line that continues nothing read here is dropped."""
        records: list[tuple[re.Match[str], list[str]]] = []
        for line in self._new_lines():
            if (m := RECORD_PATTERN.match(line)) is not None:
                records.append((m, []))
            elif records:
                records[-1][1].append(line)
        return records

    def _record(self, m: re.Match[str], more: list[str], now: float) -> None:
        rank, worker, level, message = int(m["rank"]), m["worker"], m["level"], m["message"]
        who = f"rank {rank}" + (f" worker {worker}" if worker is not None else "")
        whole = "\n".join([message, *more])  # as the launcher's last words join a record
        if worker is None and rank == 0:
            if level == "ERROR":
                self.said.add(whole)
                self.rank0.add(whole)
            return  # rank 0's own lines: on the console already
        if level == "ERROR" and message.startswith(NONFINITE.prefix):
            self._say(who, whole, now)
        elif level == "ERROR":
            self.held.append((now + HOLD_S, who, whole))
        elif worker is None and DATA_ERRORS.parse(message):
            self._out("WARNING", f"{who}: {message}")
        elif worker is None and RESOURCE_TIGHT.parse(message):
            # Another node's local rank 0 reckons that node's limits: no console of its own.
            self._out("WARNING", f"{who}: {message}")
        elif worker is None and (s := STALL.parse(message)):
            episode = (s["phase"], s["epoch"], s["step"])
            prev = self.stalls.get(rank)
            # A stop signal took the stalled rank to teardown, stuck on the same thing: the same
            # stall (ae-diagnose reads it so too), not a new one to say after the Ctrl-C
            if prev and s["phase"] == "teardown" and prev[1:] == episode[1:]:
                return
            if prev != episode:  # its first report; the repeats stay in files
                self.stalls[rank] = episode
                self._out("WARNING", f"{who}: {message}")

    def _error(self, who: str, message: str, now: float) -> bool:
        """Whether the line was said (else counted, over the source's burst)."""
        src = self.sources.setdefault(who, _Source(window_start=now))
        if src.shown < BURST:
            src.shown += 1
            self._out("ERROR", f"{who}: {message}")
            return True
        src.held += 1
        return False

    def _out(self, level: str, text: str) -> None:
        logger.log(level, text)
        self.buried |= self.rank0

    @property
    def last_words_said(self) -> set[str]:
        """The ERROR messages on the console that the launcher's last words need not repeat:
        those said whole, less rank 0's that lines of this relay came after."""
        return self.said - self.buried

    def _close_windows(self, now: float, final: bool) -> None:
        for who, src in self.sources.items():
            if not final and now - src.window_start < WINDOW_S:
                continue
            if src.held:
                more = f"{src.held} more error{'s' * (src.held != 1)}"
                self._out("ERROR", f"{who}: {more} (all in {self.train_log.name})")
            src.window_start, src.shown, src.held = now, 0, 0


@contextmanager
def rank_lines(train_log: Path) -> Iterator[RankLines]:
    """Follow `train_log` on a thread while the block runs; the last lines are said at its end,
    before whatever the launcher says next."""
    follower = RankLines(train_log)
    stop = threading.Event()

    def run() -> None:
        while not stop.wait(POLL_S):
            follower.poll()

    thread = threading.Thread(target=run, name="ae-rank-lines", daemon=True)
    thread.start()
    try:
        yield follower
    finally:
        stop.set()
        thread.join()
        follower.finish()
