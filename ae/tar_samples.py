"""Read WebDataset samples out of a tar stream.

A sample is the run of consecutive tar members sharing a key: `000123.png` and `000123.cls` form
`{"__key__": "000123", "png": b"...", "cls": b"3"}` (WebDataset's naming rule: the key is the
path up to the first dot of the file name). Shards are opened through WebDataset's `gopen`, so
local paths, `pipe:CMD` and `http(s)://` URLs all work.

Only tar parsing lives here (`iter_samples`, `scan_shard`); what to do about a bad shard is
decided by the callers (the dataset stages, the shard counter), so the parser can be swapped.
Two readers give the same samples in the same order: `fast` cuts members straight out of their
512-byte headers (`ae.tar_members`, ~10x less work per member), `tarfile` is Python's `tarfile`
module, kept selectable (`--tar_reader=tarfile`) as the plain reference.
"""

from __future__ import annotations

import tarfile
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import IO, Any, Literal, TypeVar

from webdataset.gopen import gopen

from ae.tar_members import TruncatedTar, iter_members

RawSample = dict[str, Any]
T = TypeVar("T")
TarReader = Literal["fast", "tarfile"]


def split_name(name: str) -> tuple[str, str] | None:
    """`dir/000123.seg.png` -> (`dir/000123`, `seg.png`); None for a member outside any sample
    (WebDataset's rule: the key ends at the first dot of the file name, which must not be its
    first character). String methods, not a regex: this runs once per member."""
    slash = name.rfind("/") + 1
    dot = name.find(".", slash)
    if dot <= slash:
        return None
    return name[:dot], name[dot + 1 :]


def open_shard(url: str, offset: int = 0) -> IO[bytes]:
    """Open a shard, positioned at byte `offset` (only local, seekable files can start later)."""
    stream = gopen(url, "rb")
    if offset:
        stream.seek(offset)
    return stream


def _files(tar: tarfile.TarFile) -> Iterator[tarfile.TarInfo]:
    """Regular-file members in order. TarFile keeps every member it has read in `members`;
    clearing it keeps memory flat on shards with millions of members."""
    while (info := tar.next()) is not None:
        tar.members.clear()
        if info.isfile():
            yield info


def iter_samples(url: str, offset: int = 0, reader: TarReader = "fast") -> Iterator[RawSample]:
    """Yield the samples of one shard in file order, starting at byte `offset` (a sample's
    first header, from the shard index). A sample is yielded as soon as it is known complete,
    before an error in the next sample's bytes is raised: a consumer that stops after N samples
    never sees damage past them (so a shard truncated after its Nth sample reads cleanly)."""
    if reader == "fast":
        yield from _fast_samples(url, offset)
    else:
        yield from _tarfile_samples(url, offset)


def _fast_samples(url: str, offset: int) -> Iterator[RawSample]:
    with open_shard(url, offset) as stream:
        yield from _group(iter_members(stream), url, bytes)


def _tarfile_samples(url: str, offset: int) -> Iterator[RawSample]:
    with open_shard(url, offset) as stream, tarfile.open(fileobj=stream, mode="r|*") as tar:

        def body(info: tarfile.TarInfo) -> bytes:
            f = tar.extractfile(info)
            return f.read() if f is not None else b""

        yield from _group(((info.name, info) for info in _files(tar)), url, body)


def _group(
    members: Iterable[tuple[str, T]], url: str, load: Callable[[T], bytes]
) -> Iterator[RawSample]:
    """Consecutive members sharing a key -> one sample. `load` reads a member's body once its
    sample is known: the previous sample is yielded before the next one's bytes are touched."""
    current: RawSample | None = None
    try:
        for name, payload in members:
            parts = split_name(name)
            if parts is None:
                continue
            key, ext = parts
            if current is None or current["__key__"] != key:
                if current is not None:
                    yield current
                current = {"__key__": key, "__url__": url}
            current[ext] = load(payload)
    except TruncatedTar as e:
        # A damaged member of the next sample: the current one is whole.
        parts = split_name(e.member) if e.member else None
        if current is not None and parts is not None and parts[0] != current["__key__"]:
            yield current
        raise
    if current is not None:
        yield current


@dataclass(frozen=True)
class ShardScan:
    """What a header-only pass over a shard found. On a truncated or unreadable shard `samples`
    counts the whole samples before the damage and `error` says what went wrong."""

    samples: int
    offsets: list[int] | None  # byte offset of each sample's first header; None when streamed
    error: str | None = None


def scan_shard(url: str) -> ShardScan:
    """Count the samples of a shard from its tar headers. Uncompressed local files are read by
    seeking from header to header; anything else is streamed once."""
    with open_shard(url) as stream:
        seekable = hasattr(stream, "seekable") and stream.seekable()
        if seekable:
            try:
                with tarfile.open(fileobj=stream, mode="r:") as tar:
                    return _scan(tar, with_offsets=True)
            except tarfile.ReadError:
                stream.seek(0)  # not a plain tar (compressed?): stream it below
        try:
            with tarfile.open(fileobj=stream, mode="r|*") as tar:
                return _scan(tar, with_offsets=False)
        except (tarfile.TarError, OSError, EOFError) as e:
            return ShardScan(0, None, f"not a readable tar: {type(e).__name__}: {e}")


def count_samples(url: str) -> int:
    """Whole samples of a shard, by one pass over its headers (no index, no logging)."""
    return scan_shard(url).samples


def _scan(tar: tarfile.TarFile, with_offsets: bool) -> ShardScan:
    offsets: list[int] = []
    last_key: str | None = None
    error = None
    try:
        for info in _files(tar):
            parts = split_name(info.name)
            if parts is None:
                continue
            if parts[0] != last_key:
                last_key = parts[0]
                offsets.append(info.offset)
        if with_offsets and not _ends_cleanly(tar):
            # tarfile ends silently on a header cut short: only the missing end marker tells
            error = "no end-of-archive marker: truncated"
    except (tarfile.TarError, OSError, EOFError, ValueError) as e:
        error = f"{type(e).__name__}: {e}"
    if error is None:
        return ShardScan(len(offsets), offsets if with_offsets else None)
    # The sample being read when the data ended may be incomplete: it does not count.
    whole = offsets[:-1]
    return ShardScan(len(whole), whole if with_offsets else None, error)


def _ends_cleanly(tar: tarfile.TarFile) -> bool:
    """After the last member, a seekable tar must hold a zero block (the end marker)."""
    assert tar.fileobj is not None
    tar.fileobj.seek(tar.offset)
    return tar.fileobj.read(tarfile.BLOCKSIZE) == tarfile.NUL * tarfile.BLOCKSIZE
