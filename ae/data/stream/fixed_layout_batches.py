"""The columnar fast path: whole batches gathered straight from the shard bytes.

Embedding and feature shards usually hold samples of one layout: the same members, of the same
sizes, with the same `.npy` header. In such a shard sample k's input array sits at byte
`first + k * stride + data` of the file, so a worker reads its slice by memory-mapping the shard
and gathering every batch with one vectorised take over a strided view: no tar parsing, grouping
or decoding per sample. It gives the samples, in the order, that the general path gives
(`ae.data.stream.shard_stream`): the shuffle buffer is replayed on sample indices
(`ae.data.planning.shuffle_order`), and the values are converted as `SampleDecoder.decode` converts
them.

A shard takes this path when it is a plain local tar whose first sample holds the input field as
an uncompressed `.npy` (C order, real dtype, the run's element count), and in every sample the
bytes that fix the layout are those of sample 0, one stride further each time: the input
member's tar size field, type flag, ustar magic and name suffix, and its whole `.npy` header (one
vectorised comparison of a few 8-byte words per sample, over the slice a worker reads). A
layout that changes mid-way moves or changes these bytes from the first sample that differs on:
the check names that sample. Each sample is checked once per process; the mapped shard and what
was checked are kept (`MAPPED_SHARDS` and `CHECKED`, keyed by the file's size and mtime), so a
later epoch of a persistent worker, or of the rank itself with 0 workers, starts at once.

Anything else (compressed, `pipe:`, remote, images, another field type, a mismatch anywhere in
the slice) is read by the general path, which also reports bad data; a slot whose slices cannot
all be read this way reads all of them by the general path, so its shuffle stays the same. The
rank's debug log says which path each shard slice took, and why (`SHARD_PATH`).
"""

from __future__ import annotations

import io
import math
import mmap
import os
import tarfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np
import torch
from loguru import logger

from ae.data.decoding.decode import SampleDecoder, decoding_extension
from ae.data.planning.plan import ShardSlice
from ae.data.shards.spec import is_remote
from ae.data.shards.tar_samples import DUPLICATE, ByteCount, split_name
from ae.log_lines import SHARD_PATH

WORD = 8  # the layout checks compare 8-byte words: tar blocks are 512-byte aligned


@dataclass(frozen=True)
class ColumnLayout:
    """Where the input array of every sample of one shard lies, and the bytes that vouch for it.
    Offsets after `first` are from the start of a sample (its first header)."""

    first: int  # byte offset of sample 0
    stride: int  # bytes per sample
    data: int  # the input array's first element
    dtype: str  # numpy dtype string, as in the .npy header
    length: int  # elements per sample
    check_words: tuple[int, ...]  # 8-byte word offsets that must hold sample 0's bytes
    check_masks: tuple[int, ...]  # which bytes of each word count
    expected: tuple[int, ...]  # sample 0's masked words


def _npy_header(data: bytes) -> tuple[np.dtype, tuple[int, ...], bool, int]:
    """dtype, shape, Fortran order and header length (bytes before the array) of `.npy` bytes."""
    stream = io.BytesIO(data)
    version = np.lib.format.read_magic(stream)
    read = np.lib.format.read_array_header_1_0 if version == (1, 0) else None
    shape, fortran, dtype = (read or np.lib.format.read_array_header_2_0)(stream)
    return dtype, shape, fortran, stream.tell()


def _first_sample(f: io.BufferedReader) -> tuple[dict[str, tarfile.TarInfo], int] | str:
    """The members of sample 0 by field, and where sample 1 starts; or why that is no layout."""
    try:
        tar = tarfile.open(fileobj=f, mode="r:")  # noqa: SIM115 (f is closed by the caller)
        members: dict[str, tarfile.TarInfo] = {}
        key = None
        while (info := tar.next()) is not None:
            parts = split_name(info.name) if info.isfile() else None
            if parts is None:
                continue
            if key is not None and parts[0] != key:
                return members, info.offset
            key = parts[0]
            if parts[1] in members:
                return f"field {parts[1]} appears twice in a sample"
            members[parts[1]] = info
        return members, tar.offset
    except (tarfile.TarError, OSError, EOFError, ValueError) as e:
        return f"not a plain tar ({type(e).__name__}: {e})"


def _word_checks(spans: list[tuple[int, bytes]]) -> tuple[tuple[int, ...], ...]:
    """(word offsets, masks, expected words) for byte ranges that must hold these bytes."""
    want: dict[int, list[int | None]] = {}
    for start, expected in spans:
        for i, byte in enumerate(expected):
            word, at = divmod(start + i, WORD)
            want.setdefault(word, [None] * WORD)[at] = byte
    words, masks, values = [], [], []
    for word, bytes_ in sorted(want.items()):
        mask = sum(0xFF << (8 * i) for i, b in enumerate(bytes_) if b is not None)
        value = sum((b or 0) << (8 * i) for i, b in enumerate(bytes_))
        words.append(word * WORD)
        masks.append(mask)
        values.append(value)
    return tuple(words), tuple(masks), tuple(values)


def shard_layout(url: str, decoder: SampleDecoder) -> ColumnLayout | str:
    """The columnar layout of a shard, or why it has none (it takes the general path)."""
    if decoder.kind != "vector":
        return "images are decoded per sample"
    if is_remote(url):
        return "not a local file"
    with open(url, "rb") as f:
        found = _first_sample(f)
        if isinstance(found, str):
            return found
        members, end0 = found
        present = [(fd, name) for fd, name in decoder.fields if fd in members]
        if not present:
            return f"sample 0 has no field {decoder.field_names}"
        field, name = present[0]
        ext, gzipped = decoding_extension(field)
        if ext != "npy" or gzipped or name is not None or DUPLICATE in members:
            return f"field {field} is not a plain .npy"
        info = members[field]
        f.seek(info.offset_data - tarfile.BLOCKSIZE)
        header = f.read(tarfile.BLOCKSIZE)
        head = f.read(min(info.size, 4096))
    try:
        dtype, shape, fortran, npy_len = _npy_header(head)
    except ValueError as e:
        return f"not an .npy array: {e}"
    length = math.prod(shape)
    if dtype.hasobject or dtype.kind not in "biuf" or (fortran and len(shape) > 1):
        return f".npy of dtype {dtype}{', Fortran order' if fortran else ''}"
    if (length,) != decoder.shape or npy_len + length * dtype.itemsize != info.size:
        return f".npy of shape {shape}, expected {decoder.shape}"
    first = min(m.offset for m in members.values())
    stride = end0 - first
    member = info.offset_data - tarfile.BLOCKSIZE - first  # its own header, after any pax one
    name_end = header.find(b"\0", 0, 100)
    key_len = len(info.name) - len(field) - 1
    spans = [
        (member + 124, header[124:136]),  # size
        (member + 156, header[156:157]),  # type flag
        (member + 257, header[257:263]),  # ustar magic
        (info.offset_data - first, head[:npy_len]),  # the whole .npy header
    ]
    if header[:name_end].decode("utf-8", "replace") == info.name:  # the name is in the header
        spans.append((member + key_len, header[key_len : name_end + 1]))  # `.x.npy\0`
    words, masks, expected = _word_checks(spans)
    if first % WORD or stride % WORD or stride <= 0:
        return f"samples are not {WORD}-byte aligned"
    return ColumnLayout(
        first=first,
        stride=stride,
        data=info.offset_data + npy_len - first,
        dtype=dtype.str,
        length=length,
        check_words=words,
        check_masks=masks,
        expected=expected,
    )


@dataclass
class ColumnSlice:
    """The rows of one shard slice: an (n, length) strided view over the memory-mapped shard."""

    rows: np.ndarray
    nbytes: int  # shard bytes the slice spans


@dataclass
class MappedShard:
    """A shard mapped into memory, and which of its samples were checked against its layout."""

    mapped: mmap.mmap  # the file, read-only
    layout: ColumnLayout
    checked: np.ndarray  # bool per sample

    @property
    def data(self) -> np.ndarray:
        return np.frombuffer(self.mapped, np.uint8)

    def check(self, s: ShardSlice) -> str | None:
        """Why slice `s` cannot be read by its layout (a sample not laid out so), or None. Each
        sample is checked once; a slice's pages are asked for ahead of the check."""
        if self.checked[s.start : s.stop].all():
            return None
        first, stride = self.layout.first, self.layout.stride
        if first + s.stop * stride > len(self.data):
            return f"the file ends before sample {s.stop} (truncated?)"
        start = (first + s.start * stride) // mmap.PAGESIZE * mmap.PAGESIZE
        self.mapped.madvise(mmap.MADV_WILLNEED, start, first + s.stop * stride - start)
        problem = check_samples(self.data, self.layout, s.start, s.stop)
        if problem is None:
            self.checked[s.start : s.stop] = True
        return problem

    def slice(self, s: ShardSlice) -> ColumnSlice:
        dtype = np.dtype(self.layout.dtype)
        n, stride = s.stop - s.start, self.layout.stride
        rows = np.ndarray(
            (n, self.layout.length),
            dtype,
            buffer=self.data,
            offset=self.layout.first + s.start * stride + self.layout.data,
            strides=(stride, dtype.itemsize),
        )
        return ColumnSlice(rows, n * stride)


# Shards this process has mapped and checked: (url, size, mtime) -> shard, most recent last.
# Mapped pages count in the process's RSS (shared with the page cache, reclaimable), so the
# least recently used are dropped past MAX_MAPPED_BYTES; a slice being read keeps its own map.
MAPPED_SHARDS: dict[tuple[str, int, int], MappedShard] = {}
MAX_MAPPED_BYTES = 2 << 30
# Which samples of a shard were checked outlives its map (a byte a sample): a rank reading more
# than MAX_MAPPED_BYTES of shards itself (0 workers) maps them again every epoch, and checking
# them again was ~40% of its reading (the H200 lease, docs/BENCHMARKS.md).
CHECKED: dict[tuple[str, int, int], np.ndarray] = {}


def _map(url: str) -> mmap.mmap:
    """The file, as a read-only shared map."""
    with open(url, "rb") as f:
        return mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)


def check_samples(data: np.ndarray, layout: ColumnLayout, start: int, stop: int) -> str | None:
    """Why samples [start, stop) of a mapped shard do not all have the layout, or None."""
    span = max(layout.check_words) + WORD
    words = np.ndarray(
        (stop - start, span // WORD),
        np.uint64,
        buffer=data,
        offset=layout.first + start * layout.stride,
        strides=(layout.stride, WORD),
    )
    cols = np.asarray(layout.check_words) // WORD
    masks = np.asarray(layout.check_masks, dtype=np.uint64)
    expected = np.asarray(layout.expected, dtype=np.uint64)
    bad = np.flatnonzero(((words[:, cols] & masks) != expected).any(axis=1))
    return None if bad.size == 0 else f"sample {start + int(bad[0])} is not laid out like sample 0"


def mapped_shard(url: str, count: int, decoder: SampleDecoder) -> MappedShard | str:
    """Shard `url` of `count` samples mapped (kept for later epochs), or why it takes the
    general path."""
    stat = os.stat(url) if not is_remote(url) else None
    key = (url, stat.st_size, stat.st_mtime_ns) if stat else None
    if key in MAPPED_SHARDS:
        shard = MAPPED_SHARDS.pop(key)  # type: ignore[arg-type]
        MAPPED_SHARDS[key] = shard  # type: ignore[index]
        return shard
    layout = shard_layout(url, decoder)
    if isinstance(layout, str):
        return layout
    assert key is not None
    checked = CHECKED.setdefault(key, np.zeros(count, bool))
    MAPPED_SHARDS[key] = shard = MappedShard(_map(url), layout, checked)
    while len(MAPPED_SHARDS) > 1 and sum(len(m.mapped) for m in MAPPED_SHARDS.values()) > (
        MAX_MAPPED_BYTES
    ):
        MAPPED_SHARDS.pop(next(iter(MAPPED_SHARDS)))
    return shard


class ColumnarSlot:
    """A slot's slices as one sequence of rows: `gather(positions)` -> a float32 batch."""

    def __init__(self, slices: list[ColumnSlice], scale: float) -> None:
        self.slices = slices
        self.starts = np.cumsum([0] + [len(c.rows) for c in slices])
        self.scale = np.float32(scale)

    def __len__(self) -> int:
        return int(self.starts[-1])

    def gather(self, positions: np.ndarray) -> np.ndarray:
        """The rows at `positions` (of the slot's sequence), float32, scaled as decoded. Fancy
        indexing reads only those rows of the strided views (`np.take` would first copy the
        whole view to make it contiguous)."""
        which = np.searchsorted(self.starts, positions, side="right") - 1
        lo, hi = int(which.min()), int(which.max())
        if lo == hi:
            out = _float32(self.slices[lo].rows[positions - self.starts[lo]])
        else:
            out = np.empty((len(positions), self.slices[0].rows.shape[1]), np.float32)
            for i in range(lo, hi + 1):
                mask = which == i
                out[mask] = self.slices[i].rows[positions[mask] - self.starts[i]]
        if self.scale != 1.0:
            out *= self.scale
        return out


def _float32(rows: np.ndarray) -> np.ndarray:
    """A gathered copy as float32, converted as `SampleDecoder.decode` converts (`astype`)."""
    return rows if rows.dtype == np.float32 else rows.astype(np.float32)


def _open(
    url: str, count: int, s: ShardSlice, decoder: SampleDecoder
) -> tuple[ColumnSlice | None, str]:
    """Slice `s` by the columnar path (and what it is), or None and why not."""
    try:
        shard = mapped_shard(url, count, decoder)
    except (OSError, ValueError) as e:  # unreadable: the general path reports it
        return None, f"{type(e).__name__}: {e}"
    if isinstance(shard, str):
        return None, shard
    if (problem := shard.check(s)) is not None:
        return None, problem
    layout = shard.layout
    return shard.slice(s), f"{layout.length} x {np.dtype(layout.dtype)} every {layout.stride} bytes"


def columnar_slot(
    urls: list[str],
    counts: list[int],
    slices: list[ShardSlice],
    decoder: SampleDecoder,
    debug: bool = False,
) -> ColumnarSlot | None:
    """A slot's slices by the columnar path, or None when any of them cannot take it: the whole
    slot then takes the general path (one shuffle over all of its samples, as before). With
    `debug`, each slice's path and the reason are logged (`SHARD_PATH`)."""
    if not slices:
        return None
    opened = [_open(urls[s.shard], counts[s.shard], s, decoder) for s in slices]
    columns = [c for c, _ in opened if c is not None]
    columnar = len(columns) == len(slices)
    blocker = next((why for c, why in opened if c is None), "")
    if debug:
        for s, (c, why) in zip(slices, opened, strict=True):
            if not columnar and c is not None:
                why = f"another slice of this worker needs it: {blocker}"
            logger.debug(
                SHARD_PATH.format(
                    path="columnar" if columnar else "general",
                    url=urls[s.shard],
                    start=s.start,
                    stop=s.stop,
                    why=why,
                )
            )
    return ColumnarSlot(columns, decoder.npy_scale) if columnar else None


def column_batches(
    slot: ColumnarSlot,
    order: np.ndarray,
    batch_size: int,
    count: ByteCount | None = None,
    on_slice: Callable[[int], None] | None = None,
) -> Iterator[torch.Tensor]:
    """Full batches of the rows at `order`, one gather each; `count` gets the bytes spanned and
    `on_slice` the index of the slice that each batch's first row comes from (a shuffled batch
    draws on every slice of the slot: that one stands for it)."""
    per_sample = sum(c.nbytes for c in slot.slices) // max(1, len(slot))
    for i in range(0, len(order) - batch_size + 1, batch_size):
        positions = order[i : i + batch_size]
        if on_slice is not None:
            on_slice(int(np.searchsorted(slot.starts, positions[0], side="right")) - 1)
        batch = slot.gather(positions)
        if count is not None:
            count.n += batch_size * per_sample
        yield torch.from_numpy(batch)
