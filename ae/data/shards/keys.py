"""WebDataset's key rule, where it surprises: a member's name is cut into key and field at the
FIRST dot of its file name, so `a/b/c.0001.jpg` is field `0001.jpg` of sample `a/b/c`, and files
named `c.0001.jpg`, `c.0002.jpg`, ... all become one sample with many fields. `merged_files`
spots such a sample (for the "too few samples" message and `ae-shards inspect`); `safe_key` is
what `ae.data.shards.writer` writes instead of a key whose file name has a dot.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

from ae.data.shards.tar_samples import iter_samples

# Fields of one extension in one sample from which it reads as files merged by their inner dots
# (a sample of 2-3 views, `rgb.png` and `seg.png`, is an ordinary one).
MERGED_FIELDS = 4
# Shards whose first sample `first_sample_merged` looks at: cheap, and enough to tell.
PROBED_SHARDS = 3


def merged_files(key: str, fields: Iterable[str]) -> str | None:
    """Why sample `key` is probably many files merged into one, with the fix; None if not."""
    names = [f for f in fields if not f.startswith("__") and "." in f]
    by_ext = Counter(f.rpartition(".")[2] for f in names)
    if not by_ext:
        return None
    ext, n = by_ext.most_common(1)[0]
    if n < MERGED_FIELDS:
        return None
    first = sorted(f for f in names if f.endswith(f".{ext}"))[0]
    return (
        f"sample {key} has {n} fields ending in .{ext} ({first}, ...): WebDataset splits a "
        f"member's name into key and field at the FIRST dot of its file name, so files named "
        f"{key}.{first}, ... are read as one sample. Fix: rename the members so the file name "
        f"has a single dot, before the extension (e.g. inner dots to _: {key}_{first})"
    )


def first_sample_merged(urls: list[str]) -> str | None:
    """`merged_files` on the first sample of the first few shards (unreadable ones skipped)."""
    for url in urls[:PROBED_SHARDS]:
        try:
            sample = next(iter(iter_samples(url)), None)
        except Exception:  # a damaged shard is reported where it is read
            continue
        if sample is not None and (why := merged_files(sample["__key__"], sample)):
            return why
    return None


def safe_key(key: str) -> str:
    """`key` with the dots of its file name replaced by `_` (folders keep theirs), so that
    WebDataset reads back exactly this key."""
    folder, slash, name = key.rpartition("/")
    return folder + slash + name.replace(".", "_")
