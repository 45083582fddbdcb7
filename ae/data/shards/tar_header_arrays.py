"""Tar header fields of many 512-byte blocks at once, as numpy arrays: the size field of every
block (data blocks give garbage, never used), the checksums of a chain of headers, and the sample
key of each member's name. What lets `ae.data.shards.tar_header_count` follow a shard's header
chain with one list lookup per member; the rare headers these leave out go through the fast
reader's own rules (`tar_members`).
"""

from __future__ import annotations

import numpy as np

from ae.data.shards.tar_members import BLOCK, member_name
from ae.data.shards.tar_samples import split_name

REGULAR_TYPES = np.array([ord("0"), 0, ord("7")], dtype=np.uint8)
USTAR_MAGIC = np.frombuffer(b"ustar\x00", dtype=np.uint8)
STOP = 1 << 62  # "next header" of a block the vectorised chain cannot step over


def octal_fields(fields: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Octal numbers of an (n, width) byte array: (values, ok). A field is ok when it is
    optional spaces, one run of octal digits, then NUL/space padding (what tar writers write);
    the others (base-256, garbage) are left to `tar_members._octal`."""
    digit = (fields >= 48) & (fields <= 55)
    pad = (fields == 0) | (fields == 32)
    width = fields.shape[1]
    idx = np.arange(width)
    n_digits = digit.sum(1)
    first = np.where(digit.any(1), digit.argmax(1), width)
    last = np.where(digit, idx, -1).max(1)
    ok = (n_digits > 0) & (last - first + 1 == n_digits) & (digit | pad).all(1)
    # digits after each position, as the power of 8 of that digit
    after = np.cumsum(digit[:, ::-1], axis=1)[:, ::-1] - digit
    values = np.where(digit, (fields.astype(np.int64) - 48) << (3 * after), 0).sum(1)
    return values, ok


_POW8 = 8 ** np.arange(10, -1, -1, dtype=np.int64)


def next_headers(blocks: np.ndarray) -> tuple[list[int], np.ndarray]:
    """For every block that looks like a header (ustar magic, a plain size field: what every
    tar writer writes below 8 GiB, 11 octal digits then NUL or space), the index of the block
    after its data; `STOP` for the others (data, the end marker, odd headers), which the walk
    takes one by one if the chain lands on them. Also the sizes (0 where not plain)."""
    n = len(blocks)
    looks = np.flatnonzero(blocks[:, 257] == ord("u"))  # skips data blocks for one byte each
    digits = blocks[looks, 124:135] - np.uint8(48)  # wraps below '0': only 0..7 are digits
    end = blocks[looks, 135]
    plain = (digits <= 7).all(1) & ((end == 0) | (end == 32))
    looks, digits = looks[plain], digits[plain]
    sizes = np.zeros(n, dtype=np.int64)
    sizes[looks] = digits.astype(np.int64) @ _POW8
    nxt = np.full(n, STOP, dtype=np.int64)
    nxt[looks] = looks + 1 + (sizes[looks] + BLOCK - 1) // BLOCK
    return nxt.tolist(), sizes


def checksums(headers: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The stored checksums: (values, ok). Tar writers write 6 octal digits, NUL, space; the
    rare other spellings go through `octal_fields`."""
    field = headers[:, 148:156]
    digits = field[:, :6] - np.uint8(48)
    usual = (digits <= 7).all(1) & (field[:, 6] == 0) & (field[:, 7] == 32)
    values = digits.astype(np.int64) @ _POW8[-6:]
    ok = usual.copy()
    if not usual.all():
        odd = np.flatnonzero(~usual)
        values[odd], ok[odd] = octal_fields(field[odd])
    return values, ok


def bulk_keys(headers: np.ndarray) -> list[bytes | None]:
    """Each member's sample key (None: outside any sample). Plain names by array operations,
    the rest through `split_name`."""
    used = np.flatnonzero(headers[:, :100].any(0))
    width = int(used[-1]) + 1 if len(used) else 1  # the longest name: ~14 bytes, not 100
    names = headers[:, :width]
    idx = np.arange(width)
    is_nul = names == 0
    length = np.where(is_nul.any(1), is_nul.argmax(1), width)
    inside = idx < length[:, None]
    slash = np.where((names == ord("/")) & inside, idx, -1).max(1)
    dots = (names == ord(".")) & inside & (idx > slash[:, None])
    dot = np.where(dots.any(1), dots.argmax(1), -1)
    prefixed = (headers[:, 257:263] == USTAR_MAGIC).all(1) & (headers[:, 345] != 0)
    meta = (headers[:, 0] == ord("_")) & (headers[:, 1] == ord("_"))
    simple = (dot > slash + 1) & ~prefixed & ~meta
    cut = np.where(inside & (idx < dot[:, None]), names, 0)
    keys: list[bytes | None] = np.ascontiguousarray(cut).view(f"S{width}").ravel().tolist()
    for i in np.flatnonzero(~simple).tolist():
        keys[i] = sample_key(member_name(headers[i].tobytes(), {}, None))
    return keys


def sample_key(name: str) -> bytes | None:
    parts = split_name(name)
    return None if parts is None else parts[0].encode("utf-8", "surrogateescape")
