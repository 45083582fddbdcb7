"""Count a shard's samples at the speed of reading it: a block-wise walk over its tar headers.

A tar is a chain: each 512-byte header says how many data blocks follow it, so the next header's
position depends on this one's size field. The walk reads the shard in big windows (4 MiB) and,
per window, parses the size field of *every* 512-byte block at once with numpy (a data block gives
garbage, never used), so following the chain is one list lookup per member. The headers on the
chain are then checked (checksum), typed and named in bulk: the key of a plain ustar name (no
prefix, no dot-less or `__meta__` name) is cut by array operations, and consecutive members with
the same key are one sample (WebDataset's rule, `tar_samples.split_name`). The array work is
`ae.data.shards.tar_header_arrays`.

Only the rare headers go through per-member Python, with the fast reader's own rules
(`tar_members`): PAX (`x`) and GNU long-name (`L`, `K`) headers and the member they describe, the
end-of-archive zero block, and size fields that are not 11 octal digits.

A plain local shard is memory-mapped and walked from header to header: the page cache is read in
place, and a member bigger than the window is jumped over, not read. A compressed or remote
stream is read through once (it cannot seek).
Each sample's offset is where its first member's header chain starts (the PAX or long-name header
when there is one): a reader that seeks there sees the member's full name.
"""

from __future__ import annotations

import mmap
import os
from dataclasses import dataclass, field
from typing import IO

import numpy as np

from ae.data.shards.compression import DECOMPRESSION_ERRORS
from ae.data.shards.spec import is_remote
from ae.data.shards.tar_header_arrays import (
    REGULAR_TYPES,
    STOP,
    bulk_keys,
    checksums,
    next_headers,
    sample_key,
)
from ae.data.shards.tar_members import (
    BLOCK,
    CorruptTar,
    TarError,
    TruncatedTar,
    header_fields,
    member_name,
    pax_records,
)
from ae.data.shards.tar_samples import open_shard

WINDOW = 4 << 20  # bytes read at a time: large enough that numpy's per-call cost vanishes
_EXTENDED = (b"x", b"L", b"K", b"g")  # headers whose data is not a member: handled one by one
_EXTENDED_TYPES = np.frombuffer(b"".join(_EXTENDED), dtype=np.uint8)


@dataclass
class WalkResult:
    """A header walk's findings: the offset of each sample's first header; the problem that
    stopped it (None: it ended with the end-of-archive marker)."""

    offsets: list[int] = field(default_factory=list)
    error: str | None = None
    last_key: bytes | None = None  # key of the last member seen (samples continue across windows)
    last_end: int = 0  # where the data of the last sample's first member ends

    def member(self, start: int, end: int, key: bytes | None) -> None:
        if key is not None and key != self.last_key:
            self.last_key, self.last_end = key, end
            self.offsets.append(start)

    def members(self, starts: np.ndarray, ends: np.ndarray, keys: list[bytes | None]) -> None:
        """`member` for many, comparing keys in bulk."""
        inside = np.array([k is not None for k in keys], dtype=bool)
        if not inside.any():
            return
        named = np.empty(int(inside.sum()), dtype=object)
        named[:] = [k for k in keys if k is not None]
        new = np.empty(len(named), dtype=bool)
        new[0] = named[0] != self.last_key
        new[1:] = named[1:] != named[:-1]
        self.offsets.extend(starts[inside][new].tolist())
        if new.any():
            self.last_end = int(ends[inside][new][-1])
        self.last_key = named[-1]


class _Window:
    """The shard's bytes at [base, base + len(data)): pread on a seekable file, else a stream
    read forward once (positions only grow)."""

    def __init__(self, stream: IO[bytes], fd: int | None) -> None:
        self.stream = stream
        self.base, self.data = 0, b""  # type: bytes | mmap.mmap
        self.stream_pos = 0  # bytes consumed from a stream
        self.seen = 0  # the furthest byte read: a header past it was cut off with its member
        self.failed: Exception | None = None  # a stream error, raised once its bytes are walked
        self.mapped = fd is not None and os.fstat(fd).st_size > 0
        if self.mapped:  # the page cache itself, no copy; only the pages walked are touched
            self.data = mmap.mmap(fd, 0, access=mmap.ACCESS_READ)  # type: ignore[arg-type]
            self.seen = len(self.data)

    def get(self, pos: int, n: int) -> bytes:
        """Bytes [pos, pos + n) (fewer at the end of the shard); the window then starts at pos
        and holds at least WINDOW bytes when the shard has them."""
        end = self.base + len(self.data)
        if self.mapped or (self.base <= pos and pos + n <= end):
            return self.data[pos - self.base : pos + n - self.base]
        self.data = self._stream_read(pos, max(n, WINDOW))
        self.base = pos
        if self.data:
            self.seen = max(self.seen, pos + len(self.data))
        return self.data[:n]

    def _stream_read(self, pos: int, want: int) -> bytes:
        if self.failed is not None:
            raise self.failed
        end = self.base + len(self.data)
        parts = [self.data[pos - self.base :]] if self.base <= pos < end else []
        have = len(parts[0]) if parts else 0
        try:
            while self.stream_pos < pos:  # skip a member's data
                skipped = self.stream.read(min(pos - self.stream_pos, WINDOW))
                if not skipped:
                    return b""
                self.stream_pos += len(skipped)
            while have < want:
                more = self.stream.read(want - have)
                if not more:
                    break
                parts.append(more)
                have += len(more)
                self.stream_pos += len(more)
        except DECOMPRESSION_ERRORS as e:  # the bytes before the damage are walked first
            self.failed = e
        return b"".join(parts)


def walk_headers(stream: IO[bytes], fd: int | None = None) -> WalkResult:
    """Walk the tar headers of `stream` (a plain local file: pass its `fd` to map it). Damage
    (a cut, a bad header, a decompression error) ends it with `error` set."""
    result = WalkResult()
    window = _Window(stream, fd)
    pos = 0
    while True:
        try:
            pos = _walk_window(window, pos, result)
        except (TarError, *DECOMPRESSION_ERRORS) as e:
            result.error = f"{type(e).__name__}: {e}"
            if window.failed is not None and result.offsets and result.last_end > window.seen:
                # The fast reader stops at a damaged stream before the member it cannot read
                # whole, so the sample that member starts is not even begun: do not count it.
                result.offsets.pop()
            return result
        if pos < 0:
            return result


def _walk_window(window: _Window, pos: int, result: WalkResult) -> int:
    """Walk from header `pos` to the end of the window: the chain in bulk, then the header it
    stopped at one by one. Returns the next header's position, or -1 at the end marker."""
    window.get(pos, BLOCK)
    skip = pos - window.base
    n = max(0, min(len(window.data) - skip, WINDOW) // BLOCK)
    if n == 0:
        return _member_one_by_one(window, pos, result)  # reports the truncation
    blocks = np.frombuffer(window.data, np.uint8, n * BLOCK, skip).reshape(n, BLOCK)
    nxt, sizes = next_headers(blocks)
    chain_list, k = [], 0
    while k < n:
        chain_list.append(k)
        k = nxt[k]
    stop = chain_list.pop() if k == STOP else None  # an end marker or an odd header
    chain = np.array(chain_list, dtype=np.int64)
    types = blocks[chain, 156]
    ext = np.isin(types, _EXTENDED_TYPES)
    names, hard = _extended_names(window, pos, blocks, chain, types, sizes)
    # The bulk part ends before the first extended header it cannot take (a PAX `size`, data
    # past the window) and before extended headers whose member is past the window.
    cut = len(chain) if hard is None else hard
    while cut > 0 and ext[cut - 1]:
        cut -= 1
    if cut and not _members_in_bulk(blocks, chain[:cut], ext[:cut], names, pos, nxt, result):
        raise CorruptTar("header checksum mismatch")
    if cut < len(chain):
        return _member_one_by_one(window, pos + int(chain[cut]) * BLOCK, result)
    if stop is not None:
        return _member_one_by_one(window, pos + stop * BLOCK, result)
    return pos + k * BLOCK


def _extended_names(
    window: _Window,
    pos: int,
    blocks: np.ndarray,
    chain: np.ndarray,
    types: np.ndarray,
    size: np.ndarray,
) -> tuple[dict[int, str], int | None]:
    """The names that GNU `L` and PAX `path` headers on the chain give to their member
    ({chain index of the header: name}), and the chain index of the first extended header the
    bulk walk cannot take (None: all fine): its data runs past the window, or it sets `size`.
    PAX headers that carry only times (WebDataset's TarWriter writes one per member) are told
    apart by one search over all of them at once."""
    n = len(blocks)
    both = np.flatnonzero((types == ord("x")) | (types == ord("L")))
    at = chain[both]
    past = at + 1 + (size[at] + BLOCK - 1) // BLOCK > n
    hard = int(both[past].min()) if past.any() else None
    pax = both[types[both] == ord("x")]
    small = size[chain[pax]] <= BLOCK
    one_block = pax[small & (chain[pax] + 1 < n)]
    width = int(size[chain[one_block]].max()) if len(one_block) else 0  # ~30 bytes: times
    joined = blocks[chain[one_block] + 1, :width].tobytes()
    named = {int(one_block[i // width]) for i in _find_all(joined, (b"path=", b"size="))}
    named.update(pax[~small].tolist())
    named.update(both[types[both] == ord("L")].tolist())
    names: dict[int, str] = {}
    for j in sorted(named):
        if hard is not None and j >= hard:
            break
        first = pos - window.base + (int(chain[j]) + 1) * BLOCK
        data = bytes(window.data[first : first + int(size[chain[j]])])
        if types[j] == ord("L"):
            names[j] = data.rstrip(b"\0").decode("utf-8", "surrogateescape")
            continue
        records = pax_records(data)
        if "size" in records:
            return names, j
        if "path" in records:
            names[j] = records["path"]
    return names, hard


def _find_all(data: bytes, needles: tuple[bytes, ...]) -> list[int]:
    """Where each needle occurs in `data` (bytes.find: memchr speed, no regex)."""
    found = []
    for needle in needles:
        at = data.find(needle)
        while at >= 0:
            found.append(at)
            at = data.find(needle, at + 1)
    return found


def _members_in_bulk(
    blocks: np.ndarray,
    chain: np.ndarray,
    ext: np.ndarray,
    names: dict[int, str],
    pos: int,
    nxt: list[int],
    result: WalkResult,
) -> bool:
    """Check, type and name the headers of a chain and record their samples, up to the first
    one with a bad checksum. False when there is one. A member's sample starts at its first
    extended header, and takes the name the last `L` or PAX `path` before it gives."""
    headers = blocks[chain]
    stored, ok = checksums(headers)
    total = headers.sum(1, dtype=np.uint32) - headers[:, 148:156].sum(1, dtype=np.uint32) + 8 * 32
    bad = np.flatnonzero(~ok | (total != stored))
    good = int(bad[0]) if len(bad) else len(chain)
    idx = np.arange(good)
    # each header's run of extended headers starts after the last member before it
    run_start = np.maximum.accumulate(np.where(~ext[:good], idx, -1))
    run_start = np.concatenate([[0], run_start[:-1] + 1]) if good else run_start
    regular = np.flatnonzero(~ext[:good] & np.isin(headers[:good, 156], REGULAR_TYPES))
    keys = bulk_keys(headers[regular])
    if names:  # members renamed by L / PAX path: the last PAX path wins, else the last L
        for i, j in enumerate(regular.tolist()):
            run = [h for h in range(int(run_start[j]), j) if h in names]
            if run:
                pax = [h for h in run if headers[h, 156] == ord("x")]
                keys[i] = sample_key(names[(pax or run)[-1]])
    starts = pos + chain[run_start[regular]] * BLOCK
    ends = pos + np.array([nxt[c] for c in chain[regular].tolist()], dtype=np.int64) * BLOCK
    result.members(starts, ends, keys)
    return good == len(chain)


def _member_one_by_one(window: _Window, pos: int, result: WalkResult) -> int:
    """The header chain at `pos` the fast reader's way: extended headers, then their member.
    Returns the position after the member, or -1 at the end marker."""
    start, long_name, pax = pos, None, {}
    while True:
        header = window.get(pos, BLOCK)
        if len(header) < BLOCK:
            if not header and pos > window.seen:
                raise TruncatedTar("truncated: unexpected end of data inside a member")
            if not header:
                raise TruncatedTar("truncated: no end-of-archive marker")
            raise TruncatedTar(f"truncated inside a header ({len(header)} of 512 bytes)")
        if header == bytes(BLOCK):
            return -1
        kind, size = header_fields(header, pax)
        padded = (size + BLOCK - 1) // BLOCK * BLOCK
        body = b""
        if kind in (b"x", b"L"):
            body = window.get(pos + BLOCK, size)
            if len(body) < size:
                raise TruncatedTar("truncated inside an extended header")
        end = pos + BLOCK + padded
        if kind == b"x":
            pax = pax_records(body)
        elif kind == b"L":
            long_name = body.rstrip(b"\0").decode("utf-8", "surrogateescape")
        elif kind not in _EXTENDED:
            if kind in (b"0", b"\0", b"7"):
                result.member(start, end, sample_key(member_name(header, pax, long_name)))
            return end
        pos = end


@dataclass(frozen=True)
class ShardScan:
    """What a header-only pass over a shard found. On a truncated or unreadable shard `samples`
    counts the whole samples before the damage and `error` says what went wrong."""

    samples: int
    offsets: list[int] | None  # byte offset of each sample's first header; None when streamed
    error: str | None = None


def scan_shard(url: str) -> ShardScan:
    """Count the samples of a shard from its tar headers. Plain local files are read with
    pread from header to header (and give each sample's offset); anything else, compressed
    shards included, is streamed once."""
    try:
        stream = open_shard(url)
    except TarError as e:  # a compression we cannot read
        return ShardScan(0, None, f"not a readable tar: {e}")
    seekable = stream.compression is None and not is_remote(url)
    walk: WalkResult | None = None
    try:
        with stream:
            walk = walk_headers(stream, stream.raw.fileno() if seekable else None)  # type: ignore[arg-type]
    except OSError as e:  # the command that fed it failed on close: a transfer cut, a 5xx
        if walk is None:
            raise
        walk.error = f"{type(e).__name__}: {e}"  # the cause; the whole samples before it count
    offsets = walk.offsets
    if walk.error is None:
        return ShardScan(len(offsets), offsets if seekable else None)
    if not offsets:
        return ShardScan(0, None, f"not a readable tar: {walk.error}")
    # The sample being read when the data ended may be incomplete: it does not count.
    whole = offsets[:-1]
    return ShardScan(len(whole), whole if seekable else None, walk.error)


def count_samples(url: str) -> int:
    """Whole samples of a shard, by one pass over its headers (no index, no logging)."""
    return scan_shard(url).samples
