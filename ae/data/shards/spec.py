"""Shard specs -> shard URLs.

A spec is one of: a brace pattern (`data/a-{000000..000099}.tar`), a glob (`data/*.tar`), a
directory (every shard below it, sorted: `*.tar` and the compressed `*.tar.gz`, `*.tgz`,
`*.tar.bz2`, `*.tar.xz`), `pipe:CMD`, an `http(s)://` or `gs://` URL (these may also use
braces), or several of these joined by `::`. Local shards are checked here so that a spec that
matches nothing fails before any worker process starts, and another URL scheme (`s3://`) is
refused with the `pipe:` command that streams it. No torch import: the launcher uses this.
"""

from __future__ import annotations

import glob
import os
import re
from pathlib import Path

import braceexpand

from ae.config import NO_VALIDATION
from ae.errors import UserError

REMOTE_PREFIXES = ("pipe:", "http://", "https://", "gs://", "s3://")
# Shard file names a directory spec picks up: plain tar, and the compressions the standard
# library reads (WebDataset reads the same through `tarfile`).
SHARD_SUFFIXES = (".tar", ".tar.gz", ".tgz", ".tar.bz2", ".tar.xz")
# What `ae-shards write` makes shards of (an image's sample field is its extension: `jpg`, `png`;
# a run takes any image extension as its input by default). Named in a shard spec (a common
# first mistake), they get that hint rather than a tar error from the ranks.
IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".webp", ".gif", ".bmp", ".tif", ".tiff")
ARRAY_SUFFIXES = (".npy", ".npz")


class ShardSpecError(UserError):
    """A shard spec that names no readable shard; one line per offending key."""


def is_remote(url: str) -> bool:
    return url.startswith(REMOTE_PREFIXES)


def is_shard_name(name: str) -> bool:
    return name.lower().endswith(SHARD_SUFFIXES)


def split_by_shell(args: list[str]) -> str | None:
    """What to say when shard files came as separate arguments (`a-000000.tar a-000001.tar ...`):
    the shell expanded an unquoted `{a..b}` pattern or glob into one argument per file, and a
    command taking one SPEC read the second file as its next argument. None for other words."""
    shards = [a for a in args if is_shard_name(a)]
    if len(shards) < 2:
        return None
    shown = ", ".join(shards[:2]) + (f" and {len(shards) - 2} more" if len(shards) > 2 else "")
    return (
        f"SPEC: several shard files came as separate arguments ({shown}): the shell expanded an "
        f"unquoted pattern; quote it ('{_range_of(shards)}'), or join specs with ::"
    )


def _range_of(shards: list[str]) -> str:
    """The brace pattern of shard files numbered alike (`d/train-000000.tar` ...
    `d/train-000004.tar`: `d/train-{000000..000004}.tar`), to quote; an example otherwise."""
    parts = [re.fullmatch(r"(.*?)(\d+)(\.[^/]*)", s) for s in shards]
    shapes = {(m[1], len(m[2]), m[3]) for m in parts if m is not None}
    if None in parts or len(shapes) != 1:
        return "data/train-{000000..000099}.tar"
    ((head, _, tail),) = shapes
    numbers = sorted(m[2] for m in parts if m is not None)
    return f"{head}{{{numbers[0]}..{numbers[-1]}}}{tail}"


# URL schemes a shard is opened by (WebDataset's `gopen`: curl, `gsutil cat`). Any other
# `scheme://` (s3://, file://, a typo) would fail in every rank with "no gopen handler defined"
# (or, as a path, "missing"): it is refused here with the command that streams it instead.
OPENED_SCHEMES = ("http", "https", "gs")
_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")


def _scheme_problem(part: str, key: str) -> str | None:
    """The message for a spec part whose URL scheme no shard is opened by; None otherwise."""
    match = _SCHEME.match(part)
    if match is None or match[1].lower() in OPENED_SCHEMES:
        return None
    scheme = match[1].lower()
    if scheme == "file":
        return f"{key}: {part!r}: name local shards by their path ({part[7:]}), not a file:// URL"
    how = f"'pipe:aws s3 cp {part} -'" if scheme == "s3" else "'pipe:CMD'"
    flag = f"--{key}={how}" if key.endswith("_shards") else how  # ae-shards, ae-encode: SPEC
    return (
        f"{key}: {part!r}: ae opens http(s):// and gs:// URLs and local paths, not {scheme}://; "
        f"stream the shards through a command that writes each one to stdout: {flag}"
    )


def _expand_one(spec: str) -> list[str]:
    if is_remote(spec):
        return list(braceexpand.braceexpand(spec))
    path = Path(spec).expanduser()
    if path.is_dir():
        return sorted(str(p) for p in path.rglob("*") if is_shard_name(p.name) and p.is_file())
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
        if not part.strip():
            continue
        if (problem := _scheme_problem(part.strip(), key)) is not None:
            raise ShardSpecError(problem)
        try:
            urls.extend(_expand_one(part.strip()))
        except braceexpand.UnbalancedBracesError:
            raise ShardSpecError(
                f"{key}: {part.strip()!r} has a brace that is not closed (a range is "
                "{000000..000099}, a list {a,b})"
            ) from None
    if not urls:
        raise ShardSpecError(f"{key}: {spec!r} matches no shard files{_sources_hint(spec)}")
    sources = [u for u in urls if u.lower().endswith(IMAGE_SUFFIXES + ARRAY_SUFFIXES)]
    if sources and not is_remote(sources[0]):
        # ae-shards write takes an array file itself, but images as the folder that holds them
        # (`--train_shards='photos/*.jpg'`: the folder)
        images = [u for u in sources if u.lower().endswith(IMAGE_SUFFIXES)]
        source = _images_folder(images) if images else None
        raise ShardSpecError(
            f"{key}: {sources[0]} is {Path(sources[0]).suffix} data, not a shard; make shards of "
            + (f"the images first: ae-shards write {source} DIR" if source else
               f"it first: ae-shards write {sources[0]} DIR")
            + f", then --{key}=DIR"
        )  # fmt: skip
    missing = [u for u in urls if not is_remote(u) and not Path(u).is_file()]
    if missing:
        shown = ", ".join(missing[:3]) + (
            f" and {len(missing) - 3} more" if len(missing) > 3 else ""
        )
        raise ShardSpecError(
            f"{key}: {len(missing)} of {len(urls)} shard files missing: {shown}"
            f"{_brace_hint(missing)}"
        )
    return urls


def _images_folder(images: list[str]) -> str:
    """The folder that holds `images`: their common one, or (relative and absolute paths
    mixed, which have none) the first one's."""
    try:
        return os.path.commonpath([str(Path(u).parent) for u in images])
    except ValueError:
        return str(Path(images[0]).parent)


def _brace_hint(missing: list[str]) -> str:
    """For a missing file whose name still holds braces: braceexpand left them as they were
    (`{000000...000003}`: three dots, `{0..3` unclosed), so the spec named one odd file."""
    odd = next((u for u in missing if "{" in Path(u).name or "}" in Path(u).name), None)
    if odd is None:
        return ""
    return (
        "; its braces did not expand: a range is {000000..000099} (two dots), a list {a,b}, "
        "each brace closed"
    )


def _sources_hint(spec: str) -> str:
    """For a folder with no shards but images or arrays below it: how to make shards of them."""
    path = Path(spec).expanduser()
    if is_remote(spec) or "::" in spec or not path.is_dir():
        return ""
    found = next((p for p in path.rglob("*") if p.suffix.lower() in IMAGE_SUFFIXES), None)
    if found is None:
        return ""
    return f"; it holds images ({found.name}, ...): ae-shards write {spec} DIR makes shards of them"


def resolve_shards(train_spec: str, val_spec: str | None) -> tuple[list[str], list[str] | None]:
    """Train and val URLs; val None where there is no val spec (held out of the train shards,
    `ae.data.planning.holdout`, or `none`). Problems with both keys are raised together
    (ShardSpecError, one line each). The demo data stands in for an unset spec
    (`ae.data.shards.demo`) before this."""
    result: list[list[str] | None] = []
    problems = []
    for key, spec in (("train_shards", train_spec), ("val_shards", val_spec)):
        if spec is None or spec == NO_VALIDATION:
            result.append(None)
            continue
        try:
            result.append(expand_shards(spec, key))
        except ShardSpecError as e:
            problems.append(str(e))
    if problems:
        raise ShardSpecError("\n".join(problems))
    assert result[0] is not None
    return result[0], result[1]
