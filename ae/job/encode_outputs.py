"""What an ae-encode OUT_DIR already holds, and what a run of the same command does with it.

A stopped or failed encoding of 10,000 shards must not start over: a run of the same command
skips every output shard that is complete (whole and indexed) and was written by an earlier
ae-encode of the same checkpoint, settings and input shard; it encodes the others. What "the
same" means is in `OUT_DIR/encoding.json`, written by the first node's launcher, under the
folder's lock, before any rank starts:

    {"format": "ae-encoding", "version": 1,
     "settings": {"checkpoint_sha256": "...", "field": "latent.npy", "dtype": "float32",
                  "keep_fields": ["cls"]},
     "outputs": {"train-000000.tar": "/data/train-000000.tar", ...}}

A file of an output's name that this record does not vouch for (another checkpoint or settings,
another input shard, no record: someone's data) is refused as before, unless `--overwrite`,
which encodes every output again. The ranks skip what the record vouches for and is complete
(`skipped_outputs`); they need not compare settings, as the launcher rewrote the record for
this job's before they started. No torch here.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ae import atomic_files
from ae.data.shards.index import read_index
from ae.data.shards.spec import is_remote
from ae.data.shards.writer import compression_of

RECORD_NAME = "encoding.json"
FORMAT = "ae-encoding"
VERSION = 1
_TAR_END = 1024  # a tar ends in two zero blocks of 512 bytes


@dataclass(frozen=True)
class Settings:
    """What decides an output shard's bytes, besides its input shard."""

    checkpoint_sha256: str
    field: str
    dtype: str
    keep_fields: list[str]

    def differences(self, other: Settings) -> list[str]:
        names = {"checkpoint_sha256": "checkpoint", "field": "--field", "dtype": "--dtype",
                 "keep_fields": "--keep_fields"}  # fmt: skip
        mine, theirs = asdict(self), asdict(other)
        return [names[k] for k in names if mine[k] != theirs[k]]


@dataclass
class Record:
    settings: Settings
    outputs: dict[str, str] = field(default_factory=dict)  # output file name -> its input URL


def input_id(url: str) -> str:
    """An input shard as the record names it: a local one by its absolute path (the same
    command from another folder, or with an absolute spec, names the same files)."""
    return url if is_remote(url) else str(Path(url).resolve())


def job_outputs(urls: list[str], outs: list[Path]) -> dict[str, str]:
    """This job's part of the record: output file name -> input shard."""
    return {out.name: input_id(url) for url, out in zip(urls, outs, strict=True)}


def record_path(out_dir: Path) -> Path:
    return Path(out_dir) / RECORD_NAME


def checkpoint_sha256(path: Path) -> str:
    """The checkpoint's identity: its bytes, wherever it lies (a `last.ckpt` that training has
    since replaced is another checkpoint)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(2**22):
            digest.update(chunk)
    return digest.hexdigest()


def settings_of(ckpt: Path, field_name: str, dtype: str, keep: frozenset[str]) -> Settings:
    return Settings(checkpoint_sha256(ckpt), field_name, dtype, sorted(keep))


def read_record(out_dir: Path) -> Record | None:
    """OUT_DIR's record, or None when it has none (or one this version cannot read: then no
    output is vouched for, and a file of an output's name is refused without --overwrite)."""
    try:
        doc = json.loads(record_path(out_dir).read_text())
        if doc.get("format") != FORMAT or doc.get("version") != VERSION:
            return None
        outputs = {str(k): str(v) for k, v in doc["outputs"].items()}
        return Record(Settings(**doc["settings"]), outputs)
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


def write_record(out_dir: Path, record: Record) -> None:
    doc = {"format": FORMAT, "version": VERSION, "settings": asdict(record.settings),
           "outputs": record.outputs}  # fmt: skip
    atomic_files.write(record_path(out_dir), (json.dumps(doc, indent=1) + "\n").encode())


def updated_record(old: Record | None, settings: Settings, job: dict[str, str]) -> Record:
    """The record for this job: the old one's outputs kept when they were written with these
    settings (a re-run, or another part of the same dataset), dropped otherwise (their files
    are then no longer vouched for), and this job's outputs added."""
    kept = dict(old.outputs) if old is not None and old.settings == settings else {}
    return Record(settings, {**kept, **job})


def is_complete(out: Path) -> bool:
    """A whole, indexed output shard: its index sidecar is there and names the shard's size
    (the index is written after the shard is in place), and the tar's end-of-archive blocks
    are there (writes are not fsynced: a machine that lost power may keep a shard of the right
    name and size with zeros or less in it)."""
    try:
        index = read_index(str(out), warn=False)
    except OSError:  # an index without its shard
        return False
    if index is None:
        return False
    if compression_of(out.name) != "none":  # compressed: its size, as indexed, is all to check
        return True
    if index.bytes < _TAR_END or index.bytes % 512:
        return False
    try:
        with open(out, "rb") as f:
            f.seek(index.bytes - _TAR_END)
            return f.read(_TAR_END) == bytes(_TAR_END)
    except OSError:
        return False


@dataclass
class Survey:
    """The output names OUT_DIR holds files of, by what a run does with them."""

    done: list[int] = field(default_factory=list)  # vouched for and complete: skipped
    redo: list[int] = field(default_factory=list)  # vouched for, not complete: encoded again
    foreign: list[int] = field(default_factory=list)  # not vouched for: refused
    why: str = ""  # why the foreign ones are not vouched for

    def todo(self, n: int) -> list[int]:
        """The inputs to encode, of `n`."""
        skip = set(self.done)
        return [i for i in range(n) if i not in skip]


def survey(
    urls: list[str], outs: list[Path], record: Record | None, settings: Settings | None
) -> Survey:
    """Sort the outputs OUT_DIR holds files of (the launcher's view; without a record, every
    such file is foreign and `settings` are not needed)."""
    found = Survey()
    differ = record.settings.differences(settings) if record and settings else []
    for i, (url, out) in enumerate(zip(urls, outs, strict=True)):
        if not out.exists():
            continue
        was = record.outputs.get(out.name) if record is not None else None
        if record is None or settings is None:
            found.why = (
                f"no {RECORD_NAME} there says which ae-encode wrote them (another dataset, or "
                "an ae-encode older than this one)"
            )
        elif differ:
            found.why = f"an earlier ae-encode wrote them with another {', '.join(differ)}"
        elif was is None:
            found.why = f"its {RECORD_NAME} does not list {out.name}"
        elif was != input_id(url):
            found.why = f"an earlier ae-encode wrote {out.name} from another input shard ({was})"
        else:
            (found.done if is_complete(out) else found.redo).append(i)
            continue
        found.foreign.append(i)
    return found


def skipped_outputs(
    urls: list[str], outs: list[Path], out_dir: Path, *, overwrite: bool
) -> list[int]:
    """The inputs a rank skips: their outputs are complete and vouched for by the record, which
    the launcher wrote for this job (none with `overwrite`: everything is encoded again)."""
    record = read_record(out_dir)
    if overwrite or record is None:
        return []
    return [
        i
        for i, (url, out) in enumerate(zip(urls, outs, strict=True))
        if record.outputs.get(out.name) == input_id(url) and is_complete(out)
    ]


def remove_leftovers(outs: list[Path]) -> int:
    """Remove the temporary files of output shards that a killed rank left behind (SIGKILL,
    power loss: no clean-up ran). Only under the folder's lock: no other job writes them.
    Returns how many went."""
    if not outs:
        return 0
    prefixes = tuple(f".{out.name}." for out in outs)
    folder = outs[0].parent
    if not folder.is_dir():
        return 0
    gone = 0
    for temp in atomic_files.leftovers(folder):
        if temp.name.startswith(prefixes) and temp.is_file():
            temp.unlink(missing_ok=True)
            gone += 1
    return gone
