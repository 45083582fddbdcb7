"""Compressed shards: recognise gzip, bzip2 and xz by their magic bytes and decompress on the fly.

WebDataset reads `a.tar.gz` as transparently as `a.tar` (Python's `tarfile` in `r|*` mode sniffs
the compression); so does `ae`, with the standard library's decompressors behind the same
reader. The stream is recognised by its first bytes, not its name, so `pipe:` and `http(s)://`
shards work too. A compressed shard cannot be entered in the middle: a reader that starts at
sample k decompresses from the top and skips k samples (its index sidecar holds only the count).
zstd is recognised and refused with a clear message: Python 3.11's standard library has no zstd
decoder, and neither has `tarfile`, so WebDataset cannot read such shards either.
"""

from __future__ import annotations

import bz2
import gzip
import lzma
import re
from typing import IO

from ae.data.shards.tar_members import CorruptTar

# Longest magic first is not needed: no magic is a prefix of another.
_MAGIC = {
    b"\x1f\x8b": "gzip",
    b"BZh": "bzip2",
    b"\xfd7zXZ\x00": "xz",
    b"\x28\xb5\x2f\xfd": "zstd",
}
# What a web server or object store answers instead of a shard, an error page (which `curl`
# without -f writes out as the shard), is markup; a tar begins with its first member's name.
_PAGE = re.compile(rb"\s*<(!doctype|html|\?xml|error|head|body)", re.IGNORECASE)
_HEAD = 64  # enough to tell both

# What a damaged compressed stream raises while it is read (besides the tar reader's own errors).
DECOMPRESSION_ERRORS: tuple[type[Exception], ...] = (OSError, EOFError, lzma.LZMAError)


class _Prefixed:
    """`stream` with `head` (bytes already read from it) put back in front."""

    def __init__(self, head: bytes, stream: IO[bytes]) -> None:
        self.head, self.stream = head, stream

    def read(self, n: int = -1) -> bytes:
        if not self.head:
            return self.stream.read(n)
        if n is None or n < 0:
            out, self.head = self.head + self.stream.read(), b""
            return out
        out, self.head = self.head[:n], self.head[n:]
        return out  # a short read: every reader here loops until it has what it needs

    def close(self) -> None:
        self.stream.close()


def compression_of(head: bytes) -> str | None:
    for magic, name in _MAGIC.items():
        if head.startswith(magic):
            return name
    return None


def decompressed(stream: IO[bytes]) -> tuple[IO[bytes], str | None]:
    """(the tar bytes of `stream`, its compression or None). Reads the first few bytes to tell;
    the stream returned gives them back. The caller closes `stream` itself."""
    head = b""
    while len(head) < _HEAD and (more := stream.read(_HEAD - len(head))):
        head += more  # a pipe may return short reads
    kind = compression_of(head)
    if kind is None and _PAGE.match(head):
        first = head.decode("ascii", "replace").split("\n")[0].strip()[:40]
        raise CorruptTar(
            f"not a tar but a web page ({first!r}...): an error page sent instead of the shard? "
            "(curl writes one out unless given -f: pipe:curl -f -s URL)"
        )
    raw = _Prefixed(head, stream)
    if kind is None:
        return raw, None  # type: ignore[return-value]
    if kind == "gzip":
        return gzip.GzipFile(fileobj=raw, mode="rb"), kind  # type: ignore[arg-type]
    if kind == "bzip2":
        return bz2.BZ2File(raw, mode="rb"), kind  # type: ignore[arg-type]
    if kind == "xz":
        return lzma.LZMAFile(raw, mode="rb"), kind  # type: ignore[arg-type]
    raise CorruptTar(
        f"a {kind}-compressed shard: ae reads plain, gzip, bzip2 and xz tar shards (Python's "
        "standard library has no zstd decoder); recompress it, e.g. zstd -dc a.tar.zst | gzip"
    )
