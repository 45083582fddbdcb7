"""Read WebDataset samples out of a tar stream.

A sample is the run of consecutive tar members sharing a key: `000123.png` and `000123.cls` form
`{"__key__": "000123", "png": b"...", "cls": b"3"}` (WebDataset's naming rule: the key is the
path up to the first dot of the file name). Shards are opened through WebDataset's `gopen`, so
local paths, `pipe:CMD` and `http(s)://` URLs all work.
"""

from __future__ import annotations

import re
import tarfile
from collections.abc import Iterator
from typing import IO, Any

from webdataset.gopen import gopen

_KEY_EXT = re.compile(r"^((?:.*/|)[^./]+)\.([^/]*)$")

RawSample = dict[str, Any]


def open_shard(url: str) -> IO[bytes]:
    return gopen(url, "rb")


def _members(stream: IO[bytes]) -> Iterator[tuple[str, bytes | None]]:
    """(name, data) of each regular file; data is None when only counting."""
    with tarfile.open(fileobj=stream, mode="r|*") as tar:
        for info in tar:
            if info.isfile():
                f = tar.extractfile(info)
                yield info.name, (f.read() if f is not None else b"")


def iter_samples(url: str) -> Iterator[RawSample]:
    """Yield samples of one shard in file order."""
    with open_shard(url) as stream:
        current: RawSample | None = None
        for name, data in _members(stream):
            m = _KEY_EXT.match(name)
            if m is None:
                continue  # a member without extension is not part of any sample
            key, ext = m.group(1), m.group(2)
            if current is None or current["__key__"] != key:
                if current is not None:
                    yield current
                current = {"__key__": key, "__url__": url}
            current[ext] = data
        if current is not None:
            yield current


def count_samples(url: str) -> int:
    """Number of samples in a shard, from tar headers (local files skip the member bodies)."""
    n, last = 0, None
    with open_shard(url) as stream:
        mode = "r:" if hasattr(stream, "seek") and stream.seekable() else "r|"
        with tarfile.open(fileobj=stream, mode=mode) as tar:
            for info in tar:
                m = _KEY_EXT.match(info.name) if info.isfile() else None
                if m is not None and m.group(1) != last:
                    n, last = n + 1, m.group(1)
    return n
