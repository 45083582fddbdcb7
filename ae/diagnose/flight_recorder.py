"""Reader of the Flight Recorder dumps that `ae.forensics.flight_recorder` writes: each rank's
`collectives_rank<N>_<TS>.json`, parsed without torch, and `--dump`, which asks live ranks for
theirs. `ae.diagnose.collectives` aligns them.
"""

from __future__ import annotations

import json
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ae.diagnose.heartbeats import read_heartbeat
from ae.diagnose.log_files import RunFiles
from ae.log_lines import COLLECTIVES_FILE, DUMP_REQUEST_FILE

# A library's frame, skipped when looking for the call site in the user's code (`<frozen runpy>`:
# the interpreter's own).
LIBRARY = re.compile(
    r"^<|(site|dist)-packages/|/lib/python3[.\d]*/|(^|/)(torch|lightning|ae|logging_cfg)/"
)
COLLECTIVE_CODE = ("torch/distributed/", "torch/nn/parallel/")
DUMP_WAIT_S = 10.0  # --dump: a watchdog looks every second; its first dump takes about one


@dataclass(frozen=True)
class Call:
    """One recorded collective of one rank."""

    rank: int
    pg: str
    seq: int
    op: str  # `all_reduce` (the backend prefix dropped)
    sizes: list[list[int]]
    dtypes: list[str]
    frames: tuple[tuple[str, str, int], ...]  # (function, file, line), innermost first

    @property
    def shape(self) -> str:
        """`all_reduce [3224] Float`."""
        sizes = ", ".join(f"[{', '.join(map(str, s))}]" for s in self.sizes) or "[]"
        return f"{self.op} {sizes} {', '.join(self.dtypes)}".strip()

    def key(self) -> tuple[Any, ...]:
        """What two ranks' calls at the same sequence id must share. Not the frames: ranks may
        call the same collective from different lines (`if rank == 0: ... else: ...`)."""
        return self.op, str(self.sizes), tuple(self.dtypes)

    def site(self) -> str:
        """`file:line (function)` of the call: the innermost frame of the user's code, else the
        innermost one outside torch.distributed (DDP's gradient all-reduce: autograd)."""
        user = [f for f in self.frames if not LIBRARY.search(f[1].replace("\\", "/"))]
        outside = [f for f in self.frames if not any(c in f[1] for c in COLLECTIVE_CODE)]
        frames = user or outside or list(self.frames)
        if not frames:
            return "no Python frames"
        func, path, line = frames[0]
        return f"{short_path(path)}:{line} ({func})"

    def to_json(self) -> dict[str, Any]:
        return {"rank": self.rank, "seq": self.seq, "op": self.op, "sizes": self.sizes,
                "dtypes": self.dtypes, "site": self.site()}  # fmt: skip


def short_path(path: str) -> str:
    """A frame's file without the site-packages or the project folder before it."""
    path = path.replace("\\", "/")
    _, sep, rest = path.rpartition("-packages/")
    if sep:
        return rest
    for anchor in ("/tests/", "/ae/", "/bench/"):  # the project's own folders
        if (i := path.find(anchor)) >= 0:
            return path[i + 1 :]
    return path


@dataclass
class Dump:
    rank: int
    path: Path
    reason: str
    time: float
    calls: dict[str, dict[int, Call]]  # process group -> sequence id -> call

    def last(self, pg: str) -> Call | None:
        calls = self.calls.get(pg)
        return calls[max(calls)] if calls else None


def read_dump(path: Path, rank: int) -> Dump | None:
    """A rank's dump; None for a file that is not one (torn, foreign)."""
    try:
        doc = json.loads(path.read_bytes())
        entries = doc["entries"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    calls: dict[str, dict[int, Call]] = {}
    for e in entries:
        if not isinstance(e, dict) or e.get("is_p2p") or e.get("collective_seq_id") is None:
            continue
        pg = str(e.get("pg_id", "?"))
        op = str(e.get("profiling_name", "?")).rsplit(":", 1)[-1]
        frames = tuple(
            (str(f.get("name")), str(f.get("filename")), int(f.get("line") or 0))
            for f in e.get("frames") or []
        )
        call = Call(rank, pg, int(e["collective_seq_id"]), op, e.get("input_sizes") or [],
                    [str(d) for d in e.get("input_dtypes") or []], frames)  # fmt: skip
        calls.setdefault(pg, {})[call.seq] = call
    return Dump(rank, path, str(doc.get("reason", "?")), float(doc.get("time") or 0), calls)


def request_dump(files: RunFiles, wait_s: float = DUMP_WAIT_S) -> tuple[list[int], list[int]]:
    """`--dump`: ask the live ranks of the run for their collectives (the request file their
    watchdogs look for; no signal, so nothing else a rank or its launcher handles is touched)
    and wait for their files. Returns the ranks that answered and those that did not; a rank
    whose heartbeat says its process is gone is not asked."""
    request = files.logs_dir / DUMP_REQUEST_FILE.format(ts=files.ts)
    request.write_text(f"{time.time()}\n")
    asked_at = request.stat().st_mtime
    asked = sorted(
        rank for rank, path in files.heartbeats.items()
        if (hb := read_heartbeat(path)) is not None and hb.alive is not False
    )  # fmt: skip

    def answered(rank: int) -> bool:
        path = files.logs_dir / COLLECTIVES_FILE.format(rank=rank, ts=files.ts)
        try:
            return path.stat().st_mtime >= asked_at
        except FileNotFoundError:
            return False

    end = time.monotonic() + wait_s
    while not all(map(answered, asked)) and time.monotonic() < end:
        time.sleep(0.2)
    done = [r for r in asked if answered(r)]
    return done, [r for r in asked if r not in done]
