"""Collective mismatches: the ranks' Flight Recorder dumps aligned, and the backend's own words.

Each rank's dump (`ae.diagnose.flight_recorder`) lists its recent collectives: process group,
sequence id, op, sizes, dtypes and the Python frames that issued each. Per process group the
ranks are aligned by sequence id; the first id where they differ names the rank at fault:

- `extra`: a rank issued a collective the others did not: its call site appears nowhere in the
  others' record (up to a few ids before the first difference: an extra call with the right
  sizes pairs with another one), or its later calls line up with the others' shifted by one;
- `mismatch`: the ranks called different ops, sizes or dtypes at the same id (the minority);
- `behind`: every call agrees, but a rank's last one is older than the others' (it never joined
  the next one); used only when every stalled rank waits in a collective.

Without dumps of every rank (a rank aborted by its backend has none), the backend's words in a
rank's native log (gloo's `collective mismatch in your code?`, its size mismatch; NCCL's
collective timeout) name it, and the stacks faulthandler wrote at its fatal signal give the call
site; the peers' dumps give the collective they were in.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ae.diagnose.flight_recorder import COLLECTIVE_CODE, LIBRARY, Call, Dump, short_path
from ae.diagnose.logscan import Evidence, LogBytes
from ae.log_lines import RECORD_PATTERN

# The backend says the ranks disagree (gloo), or a collective timed out (NCCL's watchdog).
_BACKEND = (
    b"Is there a distributed collective mismatch",
    b"Received data size doesn't match expected size",
    b"Watchdog caught collective operation timeout",
)
# NCCL's timeout line: `WorkNCCL(SeqNum=12, OpType=ALLREDUCE, NumelIn=3, NumelOut=3, ...)`
_NCCL_WORK = re.compile(
    r"WorkNCCL\(SeqNum=(?P<seq>\d+), OpType=(?P<op>\w+), NumelIn=(?P<numel>\d+)"
)
_FRAME = re.compile(r'^\s*File "(?P<path>[^"]+)", line (?P<line>\d+),? in (?P<func>\S+)')
TRACE_LINES = 400  # lines of a fatal-signal dump read
SHIFT_CHECKED = 3  # later calls compared when testing "one extra call"
LOOKBACK = 8  # ids before the first difference searched for an extra call (2 DDP steps)


@dataclass
class Mismatch:
    """The rank(s) at fault in one process group, and what the others did instead."""

    kind: str  # extra, mismatch, behind, backend
    pg: str | None
    seq: int | None
    ranks: list[int]
    calls: list[Call]  # the faulty rank's call(s), when recorded
    others: list[Call]  # the other ranks' calls at that sequence id
    evidence: list[Evidence] = field(default_factory=list)

    def summary(self) -> str:
        """One line: what the faulty rank did, and what the others did."""
        mine = "; ".join(f"rank {c.rank}: #{c.seq} {c.shape} at {c.site()}" for c in self.calls)
        theirs = "; ".join(f"rank {c.rank}: #{c.seq} {c.shape} at {c.site()}" for c in self.others)
        ranks = ", ".join(map(str, self.ranks))
        if self.kind == "extra":
            return f"rank {ranks} issued a collective the others did not: {mine}; instead {theirs}"
        if self.kind == "mismatch":
            return f"different collectives at #{self.seq}: {mine}; {theirs}"
        if self.kind == "behind":
            return f"rank {ranks} never joined #{self.seq}: its last is {mine}; {theirs}"
        return f"rank {ranks}: {mine or 'its collective'}; the others: {theirs or 'unknown'}"

    def to_json(self) -> dict[str, Any]:
        return {
            "kind": self.kind, "process_group": self.pg, "seq": self.seq, "ranks": self.ranks,
            "calls": [c.to_json() for c in self.calls],
            "others": [c.to_json() for c in self.others], "summary": self.summary(),
        }  # fmt: skip


def align(dumps: dict[int, Dump], all_waiting: bool = False) -> list[Mismatch]:
    """Per process group, the first sequence id where the ranks' calls differ; with
    `all_waiting` (every stalled rank waits in a collective), also a rank behind the others."""
    found = []
    pgs = sorted({pg for d in dumps.values() for pg in d.calls})
    for pg in pgs:
        ranks = {r: d.calls[pg] for r, d in dumps.items() if d.calls.get(pg)}
        if len(ranks) < 2:
            continue
        first = max(min(c) for c in ranks.values())
        last = min(max(c) for c in ranks.values())
        for seq in range(first, last + 1):
            at = {r: c[seq] for r, c in ranks.items() if seq in c}
            if len(at) == len(ranks) and len({c.key() for c in at.values()}) > 1:
                found.append(_differ(pg, seq, ranks, at))
                break
        else:
            if all_waiting and (m := _behind(pg, ranks)) is not None:
                found.append(m)
    # A rank stuck in an extra or mismatched collective cannot join the next one of another group
    # (the step vote's side group, issue 37): that is the consequence, not a second cause.
    stuck = {r for m in found if m.kind != "behind" for r in m.ranks}
    return [m for m in found if m.kind != "behind" or not set(m.ranks) <= stuck]


def _differ(pg: str, seq: int, ranks: dict[int, dict[int, Call]], at: dict[int, Call]) -> Mismatch:
    """The ranks' calls differ first at `seq`. A rank that issued an extra call shows it as a
    call site none of the others has, at most LOOKBACK ids earlier (a call the size of the
    gradient bucket pairs with the others' gradient all-reduce: the ops differ only later), or
    as calls after `seq` that are the others' shifted by one."""
    for t in range(max(seq - LOOKBACK, min(min(c) for c in ranks.values())), seq + 1):
        calls = {r: c[t] for r, c in ranks.items() if t in c}
        odd = [r for r, call in calls.items() if _unseen(call, ranks)]
        if len(odd) == 1 and len(calls) == len(ranks):
            (r,) = odd
            return Mismatch(
                "extra", pg, t, [r], [calls[r]], [c for o, c in calls.items() if o != r]
            )

    def shifted(r: int) -> bool:
        compared = 0
        for i in range(SHIFT_CHECKED):
            mine = ranks[r].get(seq + 1 + i)
            theirs = [c.get(seq + i) for o, c in ranks.items() if o != r]
            if mine is None or any(t is None for t in theirs):
                break
            if any(t.key() != mine.key() for t in theirs if t is not None):
                return False
            compared += 1
        return compared > 0

    extra = [r for r in at if shifted(r)]
    if len(extra) == 1:
        (r,) = extra
        return Mismatch("extra", pg, seq, [r], [at[r]], [c for o, c in at.items() if o != r])
    counts = Counter(c.key() for c in at.values())
    common, n = counts.most_common(1)[0]
    odd = [r for r, c in at.items() if c.key() != common] if n > 1 else sorted(at)
    others = [c for r, c in at.items() if r not in odd]
    return Mismatch("mismatch", pg, seq, odd, [at[r] for r in odd], others)


def _unseen(call: Call, ranks: dict[int, dict[int, Call]]) -> bool:
    """The call's site is in none of the other ranks' recorded calls."""
    site = call.site()
    others = (c for r, cs in ranks.items() if r != call.rank for c in cs.values())
    return all(c.site() != site for c in others)


def _behind(pg: str, ranks: dict[int, dict[int, Call]]) -> Mismatch | None:
    lasts = {r: max(c) for r, c in ranks.items()}
    low, high = min(lasts.values()), max(lasts.values())
    if low == high:
        return None
    behind = sorted(r for r, s in lasts.items() if s == low)
    ahead = [c[low + 1] for r, c in ranks.items() if r not in behind and low + 1 in c]
    return Mismatch("behind", pg, low + 1, behind, [ranks[r][low] for r in behind], ahead)


@dataclass
class Backend:
    """A rank's native log line that names a collective problem."""

    rank: int
    line: Evidence
    nccl: Call | None = None  # the collective an NCCL timeout line names


def backend_words(native_logs: dict[int, list[Path]]) -> dict[int, Backend]:
    out: dict[int, Backend] = {}
    for rank, paths in native_logs.items():
        for path in paths:
            log = LogBytes.read(path)
            hits = [p for needle in _BACKEND if (p := log.data.find(needle)) >= 0]
            if not hits:
                continue
            start = log.data.rfind(b"\n", 0, min(hits)) + 1
            line = log.evidence(start)
            nccl = None
            if m := _NCCL_WORK.search(line.text):
                nccl = Call(rank, "0", int(m["seq"]), m["op"].lower(), [[int(m["numel"])]], [], ())
            out[rank] = Backend(rank, line, nccl=nccl)
            break
    return out


def fatal_call_site(path: Path, line: int) -> tuple[str, Evidence] | None:
    """In faulthandler's dump after `line` (1-based) of a debug log (a fatal signal), the thread
    that was in a collective: the collective's function, and the innermost frame of the code
    that called it (`file:line (function)`, at that frame's line of the log)."""
    lines = path.read_text(errors="replace").splitlines()[line : line + TRACE_LINES]
    block: list[tuple[int, re.Match[str]]] = []
    for i, text in enumerate([*lines, ""], start=line + 1):
        if m := _FRAME.match(text):
            block.append((i, m))
            continue
        if found := _collective_caller(path, block):
            return found
        block = []
        if RECORD_PATTERN.match(text):  # the next log record: the dump has ended
            break
    return None


def _collective_caller(
    path: Path, block: list[tuple[int, re.Match[str]]]
) -> tuple[str, Evidence] | None:
    """A thread's frames (innermost first): the collective, and who called it."""
    collective = [b for b in block if any(c in b[1]["path"] for c in COLLECTIVE_CODE)]
    if not collective:
        return None
    callers = [b for b in block if not LIBRARY.search(b[1]["path"])]
    outside = [b for b in block if not any(c in b[1]["path"] for c in COLLECTIVE_CODE)]
    at, m = (callers or outside or block)[0]
    return collective[0][1]["func"], Evidence(
        path, at, f"{short_path(m['path'])}:{m['line']} ({m['func']})"
    )


def find_mismatches(
    dumps: dict[int, Dump],
    backend: dict[int, Backend],
    fatal: dict[int, Evidence],
    all_waiting: bool = False,
) -> list[Mismatch]:
    """The dumps aligned; without a finding there, the backend's words (`fatal`: the head line
    of each rank's fatal-signal dump, for its call site)."""
    if found := align(dumps, all_waiting):
        for m in found:
            m.evidence = _call_evidence(m, dumps) + [
                backend[r].line for r in m.ranks if r in backend
            ]
        return found
    nccl = {r: b.nccl for r, b in backend.items() if b.nccl is not None}
    if len(nccl) >= 2:  # each rank's timed-out collective, as a one-call dump
        pseudo = {
            r: Dump(r, backend[r].line.path, "NCCL timeout", 0.0, {c.pg: {c.seq: c}})
            for r, c in nccl.items()
        }
        seqs = {c.seq for c in nccl.values()}
        found = align(pseudo) if len(seqs) == 1 else align(pseudo, all_waiting=True)
        for m in found:
            m.evidence = [backend[r].line for r in (*m.ranks, *(c.rank for c in m.others))]
        return found
    out = []
    for rank, b in sorted(backend.items()):
        if b.nccl is not None:
            continue
        others = [c for r, d in dumps.items() if r != rank and (c := _last_call(d)) is not None]
        m = Mismatch("backend", others[0].pg if others else None, None, [rank], [], others)
        where = fatal_call_site(fatal[rank].path, fatal[rank].line) if rank in fatal else None
        theirs = "; ".join(f"rank {c.rank} was in #{c.seq} {c.shape}" for c in others)
        if where is not None:
            op, ev = where
            text = f"{ev.text} called {op}" + (f" while {theirs}" if theirs else "")
            m.evidence.append(Evidence(ev.path, ev.line, text))
        m.evidence.append(b.line)
        m.evidence += [Evidence(dumps[c.rank].path, 0, _describe(c)) for c in others]
        out.append(m)
    return out


def _last_call(d: Dump) -> Call | None:
    """The rank's newest call in its busiest process group (the default one, for DDP)."""
    if not d.calls:
        return None
    return d.last(max(d.calls, key=lambda pg: len(d.calls[pg])))


def _describe(c: Call, note: str = "") -> str:
    return f"rank {c.rank}: #{c.seq} {c.shape} at {c.site()}{note}"


def _call_evidence(m: Mismatch, dumps: dict[int, Dump]) -> list[Evidence]:
    note = {
        "extra": ": the others did not call it",
        "mismatch": f": differs from the others' #{m.seq}",
        "behind": f": its last; it never joined #{m.seq}",
    }.get(m.kind, "")
    mine = [Evidence(dumps[c.rank].path, 0, _describe(c, note)) for c in m.calls]
    return mine + [Evidence(dumps[c.rank].path, 0, _describe(c)) for c in m.others]
