"""Shard index sidecars: a shard's sample count (and where each sample starts) without reading it.

`train-000000.tar` gets `train-000000.tar.idx`, two JSON lines:

    {"format": "ae-shard-index", "version": 1, "samples": 375, "bytes": 194560}
    {"offsets": [0, 1536, 3072, ...]}

Line 1 is all that planning reads, so counting costs one small read per shard whatever the shard
holds. Line 2 holds the byte offset of each sample's first tar header: a reader that starts at
sample k of a local shard seeks there instead of reading and discarding k samples. `bytes` is the
shard's size when indexed: a local shard of another size (rewritten, truncated by a failed copy)
makes its index stale, and it is counted by scanning instead. A compressed shard (`.tar.gz`, ...)
cannot be entered in the middle: its sidecar holds the count and no line 2, and a reader starting
at sample k decompresses it from the top and skips k samples.

Where the sidecar of a URL lives (`index_url`): next to it for local paths and `http(s)://`
(`.../a.tar?sig=x` -> `.../a.tar.idx?sig=x`); for `pipe:CMD`, the one word of CMD that ends in
`.tar` (or `.tar.gz`, `.tgz`, `.tar.bz2`, `.tar.xz`) gets `.idx` appended (`pipe:aws s3 cp
s3://b/a.tar -` -> `pipe:aws s3 cp s3://b/a.tar.idx -`). A command with no such word, or several,
has no index and is counted by streaming it once.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

from loguru import logger

from ae import atomic_files
from ae.data.shards.spec import is_remote

INDEX_SUFFIX = ".idx"
FORMAT = "ae-shard-index"
VERSION = 1

_TAR_WORD = re.compile(
    r"(?<![^\s'\"])([^\s'\"]+\.(?:tar|tar\.gz|tgz|tar\.bz2|tar\.xz))(?=['\"]?(?:\s|$))"
)


@dataclass(frozen=True)
class ShardIndex:
    samples: int
    bytes: int
    offsets: list[int] | None = None  # only when asked for, and when the shard is seekable


def index_url(url: str) -> str | None:
    """The sidecar's URL, or None when a `pipe:` command names no single `.tar` word."""
    if url.startswith("pipe:"):
        words = _TAR_WORD.findall(url)
        if len(words) != 1:
            return None
        # stderr silenced: a missing index is normal, the shard is then counted by streaming
        return _TAR_WORD.sub(lambda m: m.group(1) + INDEX_SUFFIX, url) + " 2>/dev/null"
    base, q, query = url.partition("?") if is_remote(url) else (url, "", "")
    return f"{base}{INDEX_SUFFIX}{q}{query}"


def write_index(shard: Path, samples: int, offsets: list[int] | None) -> Path:
    """Write `shard`'s sidecar atomically (not fsynced: a lost one is remade by counting);
    `bytes` is the shard's current size."""
    path = shard.with_name(shard.name + INDEX_SUFFIX)
    head = {"format": FORMAT, "version": VERSION, "samples": samples, "bytes": shard.stat().st_size}
    lines = [json.dumps(head)]
    if offsets is not None:
        lines.append(json.dumps({"offsets": offsets}, separators=(",", ":")))
    atomic_files.write(path, "".join(f"{line}\n" for line in lines).encode(), durable=False)
    return path


def _read_lines(url: str, with_offsets: bool) -> list[bytes] | None:
    """The sidecar's first line (and second, for offsets); None when there is none."""
    side = index_url(url)
    if side is None:
        return None
    if not is_remote(url):
        try:
            with open(side, "rb") as f:
                return [f.readline(), f.readline()] if with_offsets else [f.readline()]
        except FileNotFoundError:
            return None
    try:
        from webdataset.gopen import gopen  # here: importing webdataset imports torch

        with gopen(side, "rb") as f:  # remote sidecars are small: read them whole
            data = f.read()
    except OSError:  # no such object / command failed: no index
        return None
    if not data.lstrip().startswith(b"{"):
        # No sidecar there, said by an error page (`pipe:curl -s` writes a 404's page out; S3
        # answers NoSuchKey in XML): the shard is counted by streaming it, as for any without
        return None
    return data.split(b"\n", 2)[:2]


def read_index(url: str, with_offsets: bool = False, warn: bool = True) -> ShardIndex | None:
    """The shard's index, or None when it has none, or a malformed or stale one (warned about
    unless `warn` is false: readers look again each epoch, the planner has said it once)."""
    lines = _read_lines(url, with_offsets)
    if not lines or not lines[0].strip():
        return None
    try:
        head = json.loads(lines[0])
        if head.get("format") != FORMAT or head.get("version") != VERSION:
            raise ValueError(f"not an {FORMAT} v{VERSION} file")
        samples, size = int(head["samples"]), int(head["bytes"])
        offsets = None
        if with_offsets and len(lines) > 1 and lines[1].strip():
            offsets = [int(o) for o in json.loads(lines[1])["offsets"]]
            if len(offsets) != samples:
                raise ValueError(f"{len(offsets)} offsets for {samples} samples")
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        if warn:
            logger.warning(f"Ignoring malformed index {index_url(url)}: {e}")
        return None
    if not is_remote(url) and (actual := os.path.getsize(url)) != size:
        if warn:
            logger.warning(
                f"Ignoring stale index {index_url(url)}: shard has {actual} bytes, index says "
                f"{size}"
            )
        return None
    return ShardIndex(samples, size, offsets)


def sample_offset(url: str, sample: int) -> int | None:
    """Byte offset of sample number `sample` of a local shard, if its index knows it."""
    if sample == 0:
        return 0
    if is_remote(url):
        return None
    index = read_index(url, with_offsets=True, warn=False)
    if index is None or index.offsets is None or sample >= len(index.offsets):
        return None
    return index.offsets[sample]
