"""Files that appear whole or not at all: the one write-to-temp-then-rename of `ae`.

Checkpoints, `config.yaml`, sample grids and loss curves, shards, index sidecars, the count cache,
heartbeats and the demo dataset's folder are all written here, under one guarantee: a reader of
the final name sees the previous content or the new one, never a part.

- The bytes go to a temporary file in the target's folder (a rename is atomic only within one
  filesystem), named `.<name>.<pid>-<8 hex>.tmp`: hidden, so no glob of final names (`*.tar`,
  `step-*.ckpt`, `heartbeat_rank*`) sees it; the pid says which process left it, the random part
  keeps writers on different hosts of a shared filesystem (or two threads of one process) apart,
  and the file is created exclusively, so two writers never share one.
- `durable=True` fsyncs the file before the rename and the folder after it, so the new content
  survives a power loss once the call returns. Files rewritten every few seconds (heartbeats) or
  cheap to remake pass False: an fsync there would cost the hot path for nothing.
- Any failure (ENOSPC, an exception from the writer callback, KeyboardInterrupt) removes the
  temporary file and re-raises the exception, the target as it was: unchanged, or, for a write
  that names its file (`what=`: checkpoints, the run config, plots), a full disk as DiskFullError
  with the filesystem's free space (`ae.rank.exit` says it in one line).
- A process killed mid-write (SIGKILL) cannot clean up: `leftovers(folder)` lists its temporary
  files for whoever owns the folder.
"""

from __future__ import annotations

import errno
import os
import re
import secrets
import shutil
from collections.abc import Callable
from contextlib import suppress
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import BinaryIO, TypeVar

from ae.errors import DiskFullError

_T = TypeVar("_T")
_TEMP = re.compile(r"^\..+\.\d+-[0-9a-f]{8}\.tmp$")
# errno of a write that found its filesystem full (EDQUOT: a quota, the same to the user)
DISK_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)
# Free bytes below which a failed write is taken for a full filesystem (torch.save reports
# ENOSPC as a RuntimeError that has lost the errno).
FULL_BYTES = 4 * 2**20


@dataclass(frozen=True)
class Space:
    free: int  # bytes an unprivileged writer can still use
    total: int


def fs_space(path: Path) -> Space | None:
    """Free and total bytes of the filesystem holding `path` (or its nearest existing parent)."""
    path = Path(path).absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    try:
        st = os.statvfs(path)
    except OSError:
        return None
    return Space(st.f_bavail * st.f_frsize, st.f_blocks * st.f_frsize)


def disk_full_error(exc: BaseException) -> OSError | None:
    """The ENOSPC/EDQUOT OSError behind `exc` (itself, or its cause or context), or None."""
    seen: set[int] = set()
    e: BaseException | None = exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno in DISK_FULL_ERRNOS:
            return e
        e = e.__cause__ or e.__context__
    return None


def human_size(n: float) -> str:
    if n < 1024:
        return f"{n:.0f} B"
    for unit in ("KB", "MB"):
        n /= 1024
        if n < 1024:
            return f"{n:.1f} {unit}"
    return f"{n / 1024:.2f} GB"


def _temp_name(path: Path) -> Path:
    return path.with_name(f".{path.name}.{os.getpid()}-{secrets.token_hex(4)}.tmp")


def _claim(path: Path, create: Callable[[Path], _T]) -> tuple[Path, _T]:
    """A fresh temporary name beside `path`, and what `create` made there; `create` must fail
    with FileExistsError when the name is taken (a random collision: try another)."""
    while True:
        temp = _temp_name(path)
        try:
            return temp, create(temp)
        except FileExistsError:
            continue


def leftovers(folder: Path) -> list[Path]:
    """Temporary files (and folders) in `folder` that a killed writer left behind."""
    return sorted(p for p in Path(folder).iterdir() if _TEMP.match(p.name))


def fsync_dir(folder: Path) -> None:
    """Make the names in `folder` (a rename into it) survive a crash."""
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _unlink_quietly(path: Path) -> None:
    with suppress(OSError):  # clean-up never hides the error that called for it
        path.unlink(missing_ok=True)


class AtomicFile:
    """A new version of `path` written through an open binary file, for writers that keep it
    open across calls (a shard written a sample at a time): `commit()` puts it in place,
    `discard()` drops it. As a context manager it yields the file, commits on a normal exit and
    discards on any exception.

    `on_failure` is called when writing or committing fails, before the temporary file is
    removed (a caller measures the full disk while the partial file still holds its bytes)."""

    def __init__(
        self, path: Path, *, durable: bool = True, on_failure: Callable[[], object] | None = None
    ) -> None:
        self.path = Path(path)
        self.durable = durable
        self._on_failure = on_failure
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL
        self.temp, fd = _claim(self.path, lambda temp: os.open(temp, flags, 0o666))
        self.file: BinaryIO = os.fdopen(fd, "wb")

    def commit(self) -> None:
        try:
            self.file.flush()
            if self.durable:
                os.fsync(self.file.fileno())
            self.file.close()  # a network filesystem may report a failed write only here
            os.replace(self.temp, self.path)
        except BaseException:
            self.fail()
            raise
        if self.durable:
            fsync_dir(self.path.parent)

    def fail(self) -> None:
        """Drop the new version because writing it failed (calls `on_failure` first)."""
        try:
            if self._on_failure is not None:
                self._on_failure()
        finally:
            self.discard()

    def discard(self) -> None:
        with suppress(OSError):  # flushing buffered bytes onto a full disk fails again
            self.file.close()
        _unlink_quietly(self.temp)

    def __enter__(self) -> BinaryIO:
        return self.file

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if exc is None:
            self.commit()
        else:
            self.fail()


def write(
    path: Path,
    data: bytes | Callable[[BinaryIO], object],
    *,
    durable: bool = True,
    what: str | None = None,
    on_failure: Callable[[], object] | None = None,
) -> None:
    """Replace `path` with `data`: bytes, or a callback that writes into the open binary file
    (`torch.save`, a PNG encoder, a tar writer). See `AtomicFile` for `on_failure`.

    `what` (`checkpoint`, `config`, `sample grid`) names the file for its reader: a write that
    fails on a full filesystem then raises DiskFullError with the free space, measured before the
    clean-up frees the partial file's bytes (a torch.save that fails on a full disk raises a
    RuntimeError with no errno: only the free space tells). Without it, or for any other failure,
    the error is raised as it is."""
    path = Path(path)
    spaces: list[Space | None] = []

    def failed() -> None:
        if what is not None:
            spaces.append(fs_space(path.parent))
        if on_failure is not None:
            on_failure()

    try:
        with AtomicFile(path, durable=durable, on_failure=failed) as f:
            if isinstance(data, bytes):
                f.write(data)
            else:
                data(f)
    except Exception as e:
        space = spaces[0] if spaces else None
        full = space is not None and space.free < FULL_BYTES
        if what is not None and (full or disk_full_error(e) is not None):
            free, total = (space.free, space.total) if space else (None, None)
            raise DiskFullError(what, str(path), free, total) from e
        raise


def link(src: Path, dst: Path, *, durable: bool = True) -> None:
    """Make `dst` name the same file as `src`, replacing `dst` atomically: a hard link, or a
    copy where the filesystem has no hard links (some network/FUSE filesystems)."""
    src, dst = Path(src), Path(dst)
    try:
        temp, _ = _claim(dst, lambda temp: os.link(src, temp))
    except OSError:
        with open(src, "rb") as fin:
            write(dst, lambda fout: shutil.copyfileobj(fin, fout, 16 * 2**20), durable=durable)
        return
    try:
        os.replace(temp, dst)
    except BaseException:
        _unlink_quietly(temp)
        raise
    if durable:
        fsync_dir(dst.parent)


def build_dir(path: Path, build: Callable[[Path], object]) -> None:
    """Make the folder `path` appear whole: `build(folder)` fills a temporary folder beside it,
    which is then renamed to `path`. Unlike a file, an existing `path` is kept (another process
    finished it first, and readers may be using it) and this copy dropped. Any failure removes
    the temporary folder and re-raises."""
    path = Path(path)
    temp, _ = _claim(path, Path.mkdir)
    try:
        build(temp)
        try:
            temp.rename(path)
        except OSError:
            if not path.is_dir():
                raise
            shutil.rmtree(temp, ignore_errors=True)  # another process finished first
    except BaseException:
        shutil.rmtree(temp, ignore_errors=True)
        raise
