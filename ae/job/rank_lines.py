"""The console speaks for every rank: the launcher follows the train log while the job runs.

Only rank 0's process writes to the console itself (`logging_cfg`); every rank's warnings and
errors also go to `train_<TS>.log`, rank-tagged. A thread of the launcher reads what is new there
every `POLL_S` and puts on the console, tagged `rank R` (`rank R worker W`), what rank 0 could
not say: the ERROR lines of the other ranks and of every dataloader worker (rank 0's included),
each rank's `Data errors` summary, and the first STALL line of each stall of the other ranks
(the culprit's, not only the waiting rank 0's). Uncaught exceptions stay off: the launcher prints
the diagnosis of the whole job at the end. To keep the console calm, each source shows at most
`BURST` ERROR lines per `WINDOW_S`; the rest are counted, and the count is said when the window
closes (and at the end). An ERROR line whose text rank 0 also logged (a user error every rank
finds alike), or that another rank already said, is said once: the other ranks' ERROR lines wait
`HOLD_S` for rank 0's own before they are shown. Not a NONFINITE line: it names the rank that
wrote it, so rank 0 never writes the same text, and it is said at once (a run that skips the
step goes on, and may end before the hold would: the line came after `Training finished`).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from loguru import logger

from ae.log_lines import DATA_ERRORS, NONFINITE, RECORD_PATTERN, STALL

# A line reaches the console at most this long after it is written: a run that goes on after
# an ERROR of another rank (a NONFINITE line under --on_nonfinite=skip) can end within a second.
POLL_S = 0.2
BURST = 3  # ERROR lines shown per source and window
WINDOW_S = 60.0
HOLD_S = 2.0  # an ERROR of another rank waits this long for the same text from rank 0


@dataclass
class _Source:
    window_start: float = 0.0
    shown: int = 0
    held: int = 0  # ERROR lines not shown in this window


@dataclass
class RankLines:
    """Reads the train log from where it stopped; `poll` says the new lines worth saying."""

    train_log: Path
    offset: int = 0
    partial: bytes = b""
    sources: dict[str, _Source] = field(default_factory=dict)
    stalls: dict[int, tuple[str, str, str]] = field(default_factory=dict)  # rank -> episode
    # ERROR texts on the console already (a record's first line): rank 0's own, and those said
    # here (not those counted over a burst); the launcher's last words leave them out
    said: set[str] = field(default_factory=set)
    held: list[tuple[float, str, str]] = field(default_factory=list)  # (due, who, message)

    def poll(self, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        for line in self._new_lines():
            self._line(line, now)
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
        if message not in self.said and self._error(who, message, now):
            self.said.add(message)

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

    def _line(self, line: str, now: float) -> None:
        m = RECORD_PATTERN.match(line)
        if m is None:
            return
        rank, worker, level, message = int(m["rank"]), m["worker"], m["level"], m["message"]
        who = f"rank {rank}" + (f" worker {worker}" if worker is not None else "")
        if worker is None and rank == 0:
            if level == "ERROR":
                self.said.add(message)
            return  # rank 0's own lines: on the console already
        if level == "ERROR" and message.startswith(NONFINITE.prefix):
            self._say(who, message, now)
        elif level == "ERROR":
            self.held.append((now + HOLD_S, who, message))
        elif worker is None and DATA_ERRORS.parse(message):
            logger.warning(f"{who}: {message}")
        elif worker is None and (s := STALL.parse(message)):
            episode = (s["phase"], s["epoch"], s["step"])
            if self.stalls.get(rank) != episode:  # its first report; the repeats stay in files
                self.stalls[rank] = episode
                logger.warning(f"{who}: {message}")

    def _error(self, who: str, message: str, now: float) -> bool:
        """Whether the line was said (else counted, over the source's burst)."""
        src = self.sources.setdefault(who, _Source(window_start=now))
        if src.shown < BURST:
            src.shown += 1
            logger.error(f"{who}: {message}")
            return True
        src.held += 1
        return False

    def _close_windows(self, now: float, final: bool) -> None:
        for who, src in self.sources.items():
            if not final and now - src.window_start < WINDOW_S:
                continue
            if src.held:
                logger.error(f"{who}: {src.held} more ERROR lines (all in {self.train_log.name})")
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
