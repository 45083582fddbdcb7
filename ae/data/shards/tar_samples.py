"""Read WebDataset samples out of a tar stream.

A sample is the run of consecutive tar members sharing a key: `000123.png` and `000123.seg.png`
form `{"__key__": "000123", "__url__": URL, "png": b"...", "seg.png": b"..."}`. The names follow
WebDataset's own rules (`webdataset.tariterators`): the key is the member path up to the first dot
of its file name, the field is the rest, lowercased; `__name__` members are skipped. Shards are
opened through WebDataset's `gopen`, so local paths, `pipe:CMD` and `http(s)://` URLs all work,
and gzip/bzip2/xz-compressed shards are decompressed on the fly (`ae.data.shards.compression`).

Only tar parsing lives here (`iter_samples`; the counting walk is
`ae.data.shards.tar_header_count`); what to do about a bad shard is decided by the callers (the
dataset stages, the shard counter), so the parser can be swapped.
Two readers give the same samples in the same order: `fast` cuts members straight out of their
512-byte headers (`ae.data.shards.tar_members`, ~10x less work per member), `tarfile` is Python's
`tarfile` module, kept selectable (`--tar_reader=tarfile`) as the plain reference.
"""

from __future__ import annotations

import contextlib
import re
import tarfile
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import IO, Any, Literal, TypeVar

from ae.data.shards.compression import decompressed
from ae.data.shards.pipes import plain_errors
from ae.data.shards.tar_members import TruncatedTar, iter_members

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
    # Here, not at the top: `webdataset` imports torch, and ae-shards answers a bad spec without
    # loading it.
    from webdataset.gopen import gopen

    raw = plain_errors(gopen(url, "rb"))  # a failed curl or pipe: said plainly
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

    def __exit__(self, exc_type: type[BaseException] | None, *exc: object) -> None:
        if exc_type is GeneratorExit:
            # The reader stopped early with every sample it wanted (a slice's end, the probe's
            # first sample): how the command feeding the rest ends (a transfer cut later, curl
            # stopped by the closed pipe) is not its concern. Raised here, it replaced the
            # GeneratorExit, and Python printed "Exception ignored in: <generator ...>" and a
            # traceback on the console.
            with contextlib.suppress(OSError):
                self.close()
            return
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
