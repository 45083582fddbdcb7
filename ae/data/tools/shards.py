"""The `ae-shards` commands (`ae/cli/shards.py` parses their arguments): `write` (numpy arrays
or an image folder -> shards + index sidecars), `index` (sidecars for existing shards), `inspect`
(`inspect_shards`: what the shards hold and every bad sample), `bench` (`shards_bench`: the
training input pipeline's samples/s on them)."""

from __future__ import annotations

import argparse
import collections
import contextlib
import glob
import json
import os
import re
import sys
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict
from pathlib import Path

import numpy as np
from loguru import logger
from rich.console import Console
from rich.progress import Progress

from ae.config import DataConfig
from ae.data.decoding.images import GRAYSCALE_MODES, decode_image, open_image
from ae.data.shards.errors import DataError
from ae.data.shards.index import read_index, write_index
from ae.data.shards.spec import ARRAY_SUFFIXES, IMAGE_SUFFIXES, expand_shards, is_remote
from ae.data.shards.tar_header_count import scan_shard
from ae.data.shards.writer import SUFFIXES, Sample, npy_bytes, write_shards
from ae.data.tools.inspect_shards import Inspector, print_reports
from ae.errors import UserError

_NAMED = 20  # files that cannot be decoded, named one by one on the console; then a count


class CliError(UserError):
    """Bad input: reported as one line, exit status 2."""


def _progress(console: Console) -> Progress:
    """A progress bar on a terminal; nothing in a pipe or a log file."""
    return Progress(console=console, transient=True, disable=not console.is_terminal)


# --- write ----------------------------------------------------------------------------------
def _load_array(src: Path, key: str | None) -> np.ndarray:
    try:  # a .npy is memory-mapped (rows are read as they are written); a .npz is lazy
        data = np.load(src, mmap_mode="r", allow_pickle=False)
    except Exception as e:  # a user file can be broken in many ways: all mean "not numpy"
        raise CliError(f"{src}: not a readable numpy file: {e}") from None
    if isinstance(data, np.lib.npyio.NpzFile):
        with data:
            names = list(data.files)
            if key is None and len(names) != 1:
                raise CliError(f"{src}: holds arrays {names}; pick one with --key")
            if (key or names[0]) not in names:
                raise CliError(f"{src}: no array {key!r}; it holds {names}")
            data = data[key or names[0]]
    if data.ndim < 1 or len(data) == 0:
        raise CliError(f"{src}: needs an array with at least one row; got shape {data.shape}")
    if data.dtype.kind not in "biuf":  # what a run can take as an input: no complex, no text
        raise CliError(f"{src}: holds {data.dtype} values; a sample must be real numbers "
                       "(bool, integer or float)")  # fmt: skip
    if data.ndim == 1:
        raise CliError(
            f"{src}: a 1-D array of {len(data)} values would be {len(data)} samples of one number"
            " each; reshape it to (N, 1) if that is meant, or to (1, N) for one sample"
        )
    return data


# EXIF orientations (tag 0x0112) a camera writes instead of turning the pixels, as a viewer
# applies them; 1 is upright.
_ORIENTATIONS = {
    2: "mirrored", 3: "upside down", 4: "upside down, mirrored", 5: "on its side, mirrored",
    6: "on its side", 7: "on its side, mirrored", 8: "on its side",
}  # fmt: skip


def _image_mode(path: Path) -> tuple[str | None, str | None, int]:
    """(mode, None, EXIF orientation) for an image file a run can decode, (None, why, 1) for
    one it cannot: decoded as a run decodes it, at the smallest scale (a JPEG's 1/8 draft), so
    that a corrupt or truncated photo is named here rather than replaced by another sample in
    every epoch of every run. The mode (from the header) tells which channels a run takes; the
    orientation, which a run does not apply, how a viewer would turn the picture."""
    try:
        data = path.read_bytes()
        with open_image(data) as img:
            # a PNG's EXIF can follow its pixels, which getexif() would decode whole: not read
            exif = img.getexif() if img.format in ("JPEG", "MPO", "WEBP", "TIFF") else {}
            mode, orientation = img.mode, exif.get(0x0112, 1)
        decode_image(data, "RGB", size=8)
    except Exception as e:  # a user file can be broken in many ways: all mean "cannot decode"
        return None, f"{type(e).__name__}: {e}", 1
    return mode, None, orientation if orientation in _ORIENTATIONS else 1


def _orientation_note(turned: list[tuple[Path, int]]) -> str | None:
    """What to say of the images whose EXIF orientation a viewer applies and a run does not:
    a phone's portrait photo trains on its side. None when there are none."""
    if not turned:
        return None
    shown = "; ".join(f"{p}: {_ORIENTATIONS[o]}" for p, o in turned[:3])
    more = f"; and {len(turned) - 3} more" if len(turned) > 3 else ""
    n = len(turned)
    return (
        f"{plural(n, 'image')} {'is' if n == 1 else 'are'} stored turned, with an EXIF "
        "orientation that viewers apply and a run does not (it decodes the pixels as stored, as "
        f"WebDataset does): {shown}{more}; to train upright, turn the files first (ImageMagick: "
        "mogrify -auto-orient FILE...)"
    )


def _gray_first_note(first: Path, modes: list[str]) -> str | None:
    """A run's channels follow the first image (`--channels=0`): when that is grayscale and
    others are colour, every colour photo would train as gray. What to say then (None
    otherwise); `modes`: every image's, the first's first."""
    if modes[0] not in GRAYSCALE_MODES:
        return None
    colour = collections.Counter(m for m in modes if m not in GRAYSCALE_MODES)
    if not colour:
        return None
    shown = ", ".join(f"{m} {n}" for m, n in colour.most_common())
    return (
        f"the first image ({first}) is grayscale ({modes[0]}), so a run trains 1 channel "
        f"(--channels=0: as the first image), but {colour.total()} of the {len(modes)} images "
        f"are in colour ({shown}); --channels=3 trains colour"
    )


def _sources(words: list[str]) -> list[Path]:
    """The SRC arguments as paths: a quoted glob (`'photos/*.jpg'`) expanded here, as the shell
    would have; one that matches nothing, or a path that is not there, refused by name."""
    paths: list[Path] = []
    for word in words:
        path = Path(word).expanduser()
        if not path.exists() and glob.has_magic(word):
            matched = sorted(glob.glob(str(path), recursive=True))
            if not matched:
                raise CliError(f"{word}: matches no file or folder")
            paths.extend(Path(m) for m in matched)
        elif not path.exists():
            raise CliError(f"{word}: no such file or folder")
        else:
            paths.append(path)
    return paths


def _image_files(sources: list[Path], console: Console) -> tuple[Path, list[Path]]:
    """(the folder sample paths are kept relative to, the images that decode) of image folders
    and files (a folder: every file below it); every other file is named (or counted) on the
    console. Checked in parallel on every core: a decode is ~0.1-1 ms an image."""
    files = sorted({f for p in sources for f in (p.rglob("*") if p.is_dir() else [p])
                    if f.is_file()})  # fmt: skip
    root = Path(os.path.commonpath([p if p.is_dir() else p.parent for p in sources]))
    images = [p for p in files if p.suffix.lower() in IMAGE_SUFFIXES]
    others = collections.Counter(p.suffix.lower() or "(no extension)" for p in files
                                 if p.suffix.lower() not in IMAGE_SUFFIXES)  # fmt: skip
    if not images:
        where = "below this folder" if sources[0].is_dir() else "among them"
        named = sources[0] if len(sources) == 1 else f"{sources[0]} (and {len(sources) - 1} more)"
        raise CliError(f"{named}: no {'/'.join(IMAGE_SUFFIXES)} files {where}")
    with ProcessPoolExecutor(min(os.cpu_count() or 1, 8)) as pool:
        # The workers are forked here, before the progress bar's thread exists.
        checked = pool.map(_image_mode, images, chunksize=64)
        with _progress(console) as bar:
            task = bar.add_task(f"checking {plural(len(images), 'image')}", total=len(images))
            good, modes, bad, turned = [], [], [], []
            for p, (mode, reason, orientation) in zip(images, checked, strict=True):
                if mode is not None:
                    good.append(p)
                    modes.append(mode)
                    if orientation != 1:
                        turned.append((p, orientation))
                else:
                    bad.append((p, reason))
                bar.advance(task)
    for p, reason in bad[:_NAMED]:
        console.print(f"skipped {p}: cannot decode: {reason}")
    if len(bad) > _NAMED:
        console.print(f"skipped {len(bad) - _NAMED} more that cannot be decoded")
    if others:
        n = others.total()
        kinds = ", ".join(ext if k == 1 else f"{k} {ext}" for ext, k in others.most_common())
        what = "is not an image" if n == 1 else "are not images"
        console.print(f"left out {plural(n, 'file')} that {what} ({kinds})")
    if not good:
        raise CliError(f"{root}: none of its {plural(len(images), 'image')} can be decoded")
    if (note := _gray_first_note(good[0], modes)) is not None:
        console.print(note)
    if (note := _orientation_note(turned)) is not None:
        console.print(note)
    return root, good


def _source_samples(
    sources: list[Path], key: str | None, console: Console
) -> tuple[int, Iterator[Sample]]:
    """(count, samples) of a numpy file, or of image folders and files; keys are 8-digit
    indices."""
    (src,) = sources[:1]
    if len(sources) == 1 and src.suffix in (".npy", ".npz") and src.is_file():
        array = _load_array(src, key)
        return len(array), (
            {"__key__": f"{i:08d}".encode(), "npy": npy_bytes(row)} for i, row in enumerate(array)
        )
    arrays = [p for p in sources if p.is_file() and p.suffix.lower() in ARRAY_SUFFIXES]
    if arrays:
        raise CliError(f"{arrays[0]}: a numpy file is written alone, not beside other sources")
    if len(sources) == 1 and src.is_file() and src.suffix.lower() not in IMAGE_SUFFIXES:
        raise CliError(f"{src}: expected a .npy or .npz file, or images (a folder, or files)")
    root, files = _image_files(sources, console)
    return len(files), (
        {
            "__key__": f"{i:08d}".encode(),
            p.suffix.lower()[1:]: p.read_bytes(),
            "path": str(p.relative_to(root)).encode(),  # to trace a bad sample back
        }
        for i, p in enumerate(files)
    )


def cmd_write(args: argparse.Namespace, console: Console) -> int:
    sources, out = _sources(args.src), Path(args.out_dir)
    src = sources[0]
    if out.exists() and not out.is_dir():  # was Python's "[Errno 17] File exists"
        raise CliError(f"{out}: a file, not a folder; give a folder for the shards")
    if args.key is not None and (len(sources) > 1 or src.suffix.lower() != ".npz"):
        # a .npy holds one array: a --key meant for another file would pass unnoticed
        raise CliError(f"--key picks an array of a .npz file; {src} is not one")
    if any(out.glob(f"{args.prefix}-*.tar*")):
        # Fewer new shards than old ones would leave stale shards that a folder spec picks up.
        raise CliError(f"{out} already holds {args.prefix}-*.tar* shards; use another folder")
    total, samples = _source_samples(sources, args.key, console)
    with _progress(console) as bar:
        task = bar.add_task(f"writing {total} samples", total=total)

        def counted() -> Iterator[Sample]:
            for sample in samples:
                yield sample
                bar.advance(task)

        paths = write_shards(out, args.prefix, counted(), args.per_shard, args.compress)
    suffix = SUFFIXES[args.compress]
    pattern = f"{out}/{args.prefix}-{{000000..{len(paths) - 1:06d}}}{suffix}"
    console.print(
        f"Wrote {plural(total, 'sample')} into {plural(len(paths), 'shard')} (+ .idx sidecars) "
        f"in {out}"
    )
    console.print(f"Train on them with --train_shards='{pattern}'")
    return 0


def plural(n: int, word: str) -> str:
    """`1 shard`, `18 shards`."""
    return f"{n} {word}{'' if n == 1 else 's'}"


# --- index ----------------------------------------------------------------------------------
def _local_urls(spec: str) -> list[str]:
    urls = expand_shards(spec, "shards")
    remote = [u for u in urls if is_remote(u)]
    if remote:
        raise CliError(
            f"index writes sidecars next to the shards, so they must be local; {remote[0]} is not."
            " Index the shards where they are written, then upload the .idx files beside them"
        )
    return urls


def _index_one(url: str) -> str | None:
    """Walk one shard and write its sidecar; the damage found instead, if any."""
    scan = scan_shard(url)
    if scan.error is None:
        write_index(Path(url), scan.samples, scan.offsets)
    return scan.error


def cmd_index(args: argparse.Namespace, console: Console) -> int:
    urls = _local_urls(args.spec)
    todo = [u for u in urls if args.force or read_index(u) is None]
    written = damaged = 0
    with contextlib.ExitStack() as stack:
        bar = stack.enter_context(_progress(console))
        pool = stack.enter_context(ProcessPoolExecutor(args.jobs)) if args.jobs > 1 else None
        results = pool.map(_index_one, todo) if pool else map(_index_one, todo)
        described = f"indexing {len(todo)} shards on {args.jobs} process(es)"
        tracked = bar.track(results, len(todo), description=described)
        for url, error in zip(todo, tracked, strict=True):
            if error is not None:
                logger.error(f"{url}: not indexed: {error}")
                damaged += 1
            else:
                written += 1
    kept = len(urls) - len(todo)
    console.print(f"{written} indexed, {kept} already had a current index, {damaged} damaged")
    return 1 if damaged else 0


# --- inspect ---------------------------------------------------------------------------------
def cmd_inspect(args: argparse.Namespace, console: Console) -> int:
    urls = expand_shards(args.spec, "shards")
    inspector = Inspector(args.input_key)
    with _progress(console) as bar:
        reports = [inspector.shard(u) for u in bar.track(urls, description="reading shards")]
    damaged = sum(r.damaged for r in reports)
    if args.json:
        sys.stdout.write(json.dumps([asdict(r) for r in reports], indent=1) + "\n")
    else:
        print_reports(console, reports, inspector.hints(reports))
    return 1 if damaged else 0


# --- bench ------------------------------------------------------------------------------------
def cmd_bench(args: argparse.Namespace, console: Console) -> int:
    from ae.data.tools.shards_bench import (  # here: it imports torch and lightning
        run_bench,
        summary,
    )

    if args.seconds <= 0:
        raise CliError(f"--seconds: must be > 0; got {args.seconds}")
    cfg = DataConfig(
        batch_size=args.batch_size,
        num_workers=args.num_workers,
        image_size=args.image_size,
        input_key=args.input_key,
        tar_reader=args.tar_reader,
        shard_split=args.shard_split,
    )
    try:
        result = run_bench(args.spec, cfg, args.seconds)
    except DataError as e:
        # The data module names the shards by a run's flags (`train_shards: ...`); here they are
        # the SPEC argument, whatever split the message speaks of.
        raise CliError(re.sub(r"^(train|val)_shards:", "SPEC:", e.render())) from None
    if args.json:
        sys.stdout.write(json.dumps(asdict(result)) + "\n")
    else:
        for line in summary(result):
            console.print(line)
    return 0
