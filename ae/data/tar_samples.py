"""Read WebDataset samples out of a tar stream.

A sample is the run of consecutive tar members sharing a key: `000123.png` and `000123.seg.png`
form `{"__key__": "000123", "__url__": URL, "png": b"...", "seg.png": b"..."}`. The names follow
WebDataset's own rules (`webdataset.tariterators`): the key is the member path up to the first dot
of its file name, the field is the rest, lowercased; `__name__` members are skipped. Shards are
opened through WebDataset's `gopen`, so local paths, `pipe:CMD` and `http(s)://` URLs all work,
and gzip/bzip2/xz-compressed shards are decompressed on the fly (`ae.data.compression`).

Only tar parsing lives here (`iter_samples`, `scan_shard`); what to do about a bad shard is
decided by the callers (the dataset stages, the shard counter), so the parser can be swapped.
Two readers give the same samples in the same order: `fast` cuts members straight out of their
512-byte headers (`ae.data.tar_members`, ~10x less work per member), `tarfile` is Python's `tarfile`
module, kept selectable (`--tar_reader=tarfile`) as the plain reference.
"""

from __future__ import annotations

import re
import tarfile
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import IO, Any, Literal, TypeVar

from webdataset.gopen import gopen

from ae.data.compression import DECOMPRESSION_ERRORS, decompressed
from ae.data.tar_members import TarError, TruncatedTar, iter_members

RawSample = dict[str, Any]
T = TypeVar("T")
DUPLICATE = "__duplicate__"  # set on a sample holding a field twice: the decoder rejects it
TarReader = Literal["fast", "tarfile"]


# WebDataset's own patterns (`webdataset.tariterators.base_plus_ext`, `tar_file_iterator`).
_WDS_NAME = re.compile(r"^((?:.*/|)[^.]+)[.]([^/]*)$")
_WDS_META = re.compile(r"__[^/]*__($|/)")


def split_name(name: str) -> tuple[str, str] | None:
    """`dir/000123.seg.PNG` -> (`dir/000123`, `seg.png`); None for a member outside any sample.
    Exactly WebDataset's rule (its regex, its lowercased field, its skipped `__meta__` names);
    string methods answer the usual names, which a regex would cost a microsecond each."""
    slash = name.rfind("/") + 1
    dot = name.find(".", slash)
    if dot <= slash or name.startswith("__"):  # no dot, a leading dot, or a meta name: rare
        if _WDS_META.match(name):
            return None
        match = _WDS_NAME.match(name)
        return None if match is None else (match.group(1), match.group(2).lower())
    return name[:dot], name[dot + 1 :].lower()


def open_shard(url: str, offset: int = 0) -> TarStream:
    """Open a shard's tar bytes (decompressed), positioned at byte `offset` of the tar (only
    plain local files can start later: an offset comes from an index, and a compressed shard's
    index holds none)."""
    raw = gopen(url, "rb")
    try:
        if offset:
            raw.seek(offset)
            return TarStream(raw, raw, None)
        reader, compression = decompressed(raw)
    except BaseException:
        raw.close()
        raise
    return TarStream(reader, raw, compression)


class TarStream:
    """The tar bytes of a shard (`read`), the file or pipe they come from (`raw`), and how they
    are compressed (None: plain). Closing it closes both."""

    def __init__(self, reader: IO[bytes], raw: IO[bytes], compression: str | None) -> None:
        self.reader, self.raw, self.compression = reader, raw, compression
        # A decompressor's `read(n)` raises at a cut before returning any of the n bytes; `read1`
        # returns what it has, so the samples before the damage are still read.
        self.read = reader.read1 if compression else reader.read  # type: ignore[attr-defined]

    def close(self) -> None:
        try:
            if self.reader is not self.raw:
                self.reader.close()
        finally:
            self.raw.close()

    def __enter__(self) -> TarStream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _files(tar: tarfile.TarFile) -> Iterator[tarfile.TarInfo]:
    """Regular-file members in order. TarFile keeps every member it has read in `members`;
    clearing it keeps memory flat on shards with millions of members."""
    while (info := tar.next()) is not None:
        tar.members.clear()
        if info.isfile():
            yield info


@dataclass
class ByteCount:
    """Bytes read so far by the shard streams counted into it (one reader: no lock)."""

    n: int = 0


class _Counted:
    """A read-only stream that adds what it reads to a ByteCount. Both readers read in big
    chunks (1 MB for `fast`), so this costs one addition per chunk."""

    def __init__(self, stream: IO[bytes], count: ByteCount) -> None:
        self.stream = stream
        self.count = count

    def read(self, n: int = -1) -> bytes:
        data = self.stream.read(n)
        self.count.n += len(data)
        return data

    def __getattr__(self, name: str) -> Any:
        return getattr(self.stream, name)


def iter_samples(
    url: str, offset: int = 0, reader: TarReader = "fast", count: ByteCount | None = None
) -> Iterator[RawSample]:
    """Yield the samples of one shard in file order, starting at byte `offset` (a sample's
    first header, from the shard index). A sample is yielded as soon as it is known complete,
    before an error in the next sample's bytes is raised: a consumer that stops after N samples
    never sees damage past them (so a shard truncated after its Nth sample reads cleanly).
    `count`: adds the bytes read from the shard (for the worker's read rate)."""
    if reader == "fast":
        yield from _fast_samples(url, offset, count)
    else:
        yield from _tarfile_samples(url, offset, count)


def _fast_samples(url: str, offset: int, count: ByteCount | None) -> Iterator[RawSample]:
    with open_shard(url, offset) as stream:
        source = stream if count is None else _Counted(stream, count)
        yield from _group(iter_members(source), url, bytes)  # type: ignore[arg-type]


def _tarfile_samples(url: str, offset: int, count: ByteCount | None) -> Iterator[RawSample]:
    with open_shard(url, offset) as raw:
        stream = raw if count is None else _Counted(raw, count)
        with tarfile.open(fileobj=stream, mode="r|") as tar:  # type: ignore[call-overload]
            yield from _tar_group(tar, url)


def _tar_group(tar: tarfile.TarFile, url: str) -> Iterator[RawSample]:
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
            if ext in current:  # WebDataset stops there; here only this sample is bad
                current[DUPLICATE] = f"{name}: field {ext} appears twice in the sample"
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
    """Count the samples of a shard from its tar headers. Plain local files are read by seeking
    from header to header (and give each sample's offset); anything else, compressed shards
    included, is streamed once through the fast reader."""
    try:
        stream = open_shard(url)
    except TarError as e:  # a compression we cannot read
        return ShardScan(0, None, f"not a readable tar: {e}")
    with stream:
        raw = stream.raw
        if stream.compression is None and hasattr(raw, "seekable") and raw.seekable():
            raw.seek(0)
            try:
                with tarfile.open(fileobj=raw, mode="r:") as tar:
                    return _scan(tar, with_offsets=True)
            except tarfile.ReadError as e:
                return ShardScan(0, None, f"not a readable tar: ReadError: {e}")
        return _scan_stream(stream)


def _scan_stream(stream: TarStream) -> ShardScan:
    samples, last_key = 0, None
    try:
        for name, _ in iter_members(stream):  # type: ignore[arg-type]
            parts = split_name(name)
            if parts is not None and parts[0] != last_key:
                last_key, samples = parts[0], samples + 1
    except (TarError, *DECOMPRESSION_ERRORS) as e:
        if samples == 0:
            return ShardScan(0, None, f"not a readable tar: {type(e).__name__}: {e}")
        # The sample being read when the data ended may be incomplete: it does not count.
        return ShardScan(samples - 1, None, f"{type(e).__name__}: {e}")
    return ShardScan(samples, None)


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
