"""Shard specs -> shard URLs.

A spec is one of: a brace pattern (`data/a-{000000..000099}.tar`), a glob (`data/*.tar`), a
directory (all `*.tar` below it, sorted), `pipe:CMD` or an `http(s)://` URL (either may also use
braces), or several of these joined by `::`. Local shards are checked here so that a spec that
matches nothing fails before any worker process starts. No torch import: the launcher uses this.
"""

from __future__ import annotations

import glob
from pathlib import Path

import braceexpand

REMOTE_PREFIXES = ("pipe:", "http://", "https://", "gs://", "s3://")


class ShardSpecError(ValueError):
    pass


def is_remote(url: str) -> bool:
    return url.startswith(REMOTE_PREFIXES)


def _expand_one(spec: str) -> list[str]:
    if is_remote(spec):
        return list(braceexpand.braceexpand(spec))
    path = Path(spec).expanduser()
    if path.is_dir():
        return sorted(str(p) for p in path.rglob("*.tar"))
    urls: list[str] = []
    for pattern in braceexpand.braceexpand(str(path)):
        if glob.has_magic(pattern):
            urls.extend(sorted(glob.glob(pattern, recursive=True)))
        else:
            urls.append(pattern)
    return urls


def expand_shards(spec: str, key: str = "train_shards") -> list[str]:
    """Expand `spec` into URLs; raise ShardSpecError naming `key` and the missing files."""
    urls: list[str] = []
    for part in spec.split("::"):
        if part.strip():
            urls.extend(_expand_one(part.strip()))
    if not urls:
        raise ShardSpecError(f"{key}: {spec!r} matches no shard files")
    missing = [u for u in urls if not is_remote(u) and not Path(u).is_file()]
    if missing:
        shown = ", ".join(missing[:3]) + (
            f" and {len(missing) - 3} more" if len(missing) > 3 else ""
        )
        raise ShardSpecError(f"{key}: {len(missing)} of {len(urls)} shard files missing: {shown}")
    return urls


def resolve_shards(train_spec: str | None, val_spec: str | None) -> tuple[list[str], list[str]]:
    """Train and val URLs; the embedded demo data stands in for a spec left unset.
    Problems with both keys are raised together (ShardSpecError, one line each)."""
    if train_spec is None or val_spec is None:
        from ae.demo_data import demo_shard_specs

        demo_train, demo_val = demo_shard_specs()
        train_spec, val_spec = train_spec or demo_train, val_spec or demo_val
    result, problems = [], []
    for key, spec in (("train_shards", train_spec), ("val_shards", val_spec)):
        try:
            result.append(expand_shards(spec, key))
        except ShardSpecError as e:
            problems.append(str(e))
    if problems:
        raise ShardSpecError("\n".join(problems))
    return result[0], result[1]
