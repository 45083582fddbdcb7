"""Files that appear whole or not at all (`ae.atomic_files`): the unit's failure paths, and every
kind of file `ae` writes on a real full filesystem."""

from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from ae import atomic_files
from ae.atomic_files import disk_full_error, fs_space, human_size
from tests.support.limits import in_namespace, namespace_problem
from tests.support.runs import ROOT


def test_write_replaces_the_file_with_the_usual_permissions(tmp_path: Path) -> None:
    target = tmp_path / "a.json"
    atomic_files.write(target, b"old")
    atomic_files.write(target, lambda f: f.write(b"new"), durable=False)
    assert target.read_bytes() == b"new"
    assert os.listdir(tmp_path) == ["a.json"]
    umask = os.umask(0)
    os.umask(umask)
    assert target.stat().st_mode & 0o777 == 0o666 & ~umask  # as open() makes it, not 0600


@pytest.mark.parametrize("error", [OSError(28, "No space left on device"), KeyboardInterrupt()])
def test_a_failure_mid_write_leaves_the_old_file_and_no_temp(
    tmp_path: Path, error: BaseException
) -> None:
    target = tmp_path / "a.ckpt"
    target.write_bytes(b"old")

    def broken(f) -> None:
        f.write(b"half of the new")
        f.flush()  # the partial bytes are really on disk
        assert len(atomic_files.leftovers(tmp_path)) == 1
        raise error

    with pytest.raises(type(error)) as raised:
        atomic_files.write(target, broken)
    assert raised.value is error  # re-raised unchanged: the ENOSPC verdict still finds its errno
    assert target.read_bytes() == b"old"
    assert os.listdir(tmp_path) == ["a.ckpt"]


def test_on_failure_runs_while_the_partial_file_is_there(tmp_path: Path) -> None:
    target = tmp_path / "a.ckpt"
    seen: list[int] = []

    def broken(f) -> None:
        f.write(b"x" * 5000)
        raise RuntimeError("file write failed")  # as torch.save says it: no errno

    def on_failure() -> None:
        seen.extend(p.stat().st_size for p in atomic_files.leftovers(tmp_path))

    with pytest.raises(RuntimeError, match="file write failed"):
        atomic_files.write(target, broken, on_failure=on_failure)
    assert seen == [5000] and os.listdir(tmp_path) == []


def test_temp_names_are_hidden_beside_the_target_and_never_shared(tmp_path: Path) -> None:
    target = tmp_path / "step-00000002.ckpt"
    first, second = atomic_files.AtomicFile(target), atomic_files.AtomicFile(target)
    assert first.temp != second.temp
    for f in (first, second):
        assert f.temp.parent == tmp_path
        assert f.temp.name.startswith(f".{target.name}.{os.getpid()}-")
        assert f.temp.name.endswith(".tmp")
    assert not list(tmp_path.glob("step-*.ckpt"))  # no glob of final names sees them
    assert atomic_files.leftovers(tmp_path) == sorted([first.temp, second.temp])
    first.file.write(b"first")
    second.file.write(b"second")
    first.commit()
    second.commit()
    assert target.read_bytes() == b"second" and os.listdir(tmp_path) == [target.name]


def test_concurrent_writers_of_one_file_never_collide(tmp_path: Path) -> None:
    """Threads rewriting one file (a heartbeat from the watchdog and from the main thread; a
    shared count cache): each write succeeds whole, the last one wins, nothing is left."""
    target = tmp_path / "heartbeat_rank0_TS.json"
    errors: list[BaseException] = []

    def writer(i: int) -> None:
        try:
            for j in range(100):
                atomic_files.write(target, json.dumps([i, j]).encode() * 50, durable=False)
        except BaseException as e:  # reported by the test thread
            errors.append(e)

    threads = [threading.Thread(target=writer, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    i, j = json.loads(target.read_bytes()[: len(target.read_bytes()) // 50])
    assert j == 99 and i in range(4)
    assert os.listdir(tmp_path) == [target.name]


KILLED_MID_WRITE = """
import os, signal, sys
from pathlib import Path
from ae import atomic_files
def killed(f):
    f.write(b"partial")
    f.flush()
    os.kill(os.getpid(), signal.SIGKILL)
atomic_files.write(Path(sys.argv[1]), killed)
"""


def test_a_killed_writer_leaves_a_temp_file_that_leftovers_finds(tmp_path: Path) -> None:
    target = tmp_path / "a.ckpt"
    target.write_bytes(b"old")
    res = subprocess.run(
        [sys.executable, "-c", KILLED_MID_WRITE, str(target)], cwd=ROOT, timeout=60
    )
    assert res.returncode == -signal.SIGKILL
    (left,) = atomic_files.leftovers(tmp_path)
    assert left.read_bytes() == b"partial" and left.name.startswith(".a.ckpt.")
    assert target.read_bytes() == b"old"


def test_link_replaces_the_name_with_the_same_file(tmp_path: Path) -> None:
    step, last = tmp_path / "step-2.ckpt", tmp_path / "last.ckpt"
    step.write_bytes(b"step 2")
    last.write_bytes(b"step 1")
    atomic_files.link(step, last)
    assert os.path.samefile(step, last) and last.read_bytes() == b"step 2"
    assert sorted(os.listdir(tmp_path)) == ["last.ckpt", "step-2.ckpt"]


def test_link_copies_where_no_hard_link_can_be_made(tmp_path: Path) -> None:
    """A hard link across filesystems fails like one on a filesystem without links: a copy."""
    shm = Path("/dev/shm")
    if not shm.is_dir() or shm.stat().st_dev == tmp_path.stat().st_dev:
        pytest.skip("no second filesystem (/dev/shm) here")
    src = shm / f"ae_test_link_{os.getpid()}"
    src.write_bytes(b"step 2")
    try:
        atomic_files.link(src, tmp_path / "last.ckpt")
    finally:
        src.unlink()
    assert (tmp_path / "last.ckpt").read_bytes() == b"step 2"
    assert os.listdir(tmp_path) == ["last.ckpt"]


def test_build_dir_appears_whole_or_not_at_all(tmp_path: Path) -> None:
    root = tmp_path / "digits"

    def broken(folder: Path) -> None:
        (folder / "train-000000.tar").write_bytes(b"half a dataset")
        raise OSError(28, "No space left on device")

    with pytest.raises(OSError, match="No space"):
        atomic_files.build_dir(root, broken)
    assert os.listdir(tmp_path) == []
    atomic_files.build_dir(root, lambda folder: (folder / "DONE").write_text("ok\n"))
    assert os.listdir(root) == ["DONE"]
    # a process that finishes second keeps the first one's folder and drops its own copy
    atomic_files.build_dir(root, lambda folder: (folder / "OTHER").write_text("x"))
    assert os.listdir(root) == ["DONE"] and os.listdir(tmp_path) == ["digits"]


KINDS = ("checkpoint", "index", "counts", "shard", "shard_closing", "heartbeat")


def test_every_kind_of_file_on_a_full_disk_leaves_nothing_partial(tmp_path: Path) -> None:
    """A real ENOSPC: per kind, a 1 MB tmpfs in a private mount namespace and the real writing
    function (tests/support/full_disk.py). The previous version stays whole at its name, no
    temporary file is left, and the error is the one each caller expects (the checkpoint's
    named `Disk full`; the count cache's only warned about: the count itself stands)."""
    mnt = tmp_path / "mnt"
    mounts = "\n".join(
        f"mkdir -p {mnt}/{k} && mount -t tmpfs -o size=1m tmpfs {mnt}/{k}" for k in KINDS
    )
    res = in_namespace(
        f"{mounts}\n$PY -m tests.support.full_disk {mnt}", tmp_path / "run", timeout=120
    )
    assert res.returncode == 0, res.stderr[-3000:]
    got = json.loads(res.stdout.strip().splitlines()[-1])
    enospc = "OSError ENOSPC"
    assert got == {
        "checkpoint": {"raised": "DiskFullError ENOSPC", "kept": True,
                       "files": ["last.ckpt", "step-00000002.ckpt"]},
        "index": {"raised": enospc, "kept": True, "files": ["a.tar", "a.tar.idx"]},
        "counts": {"raised": None, "kept": True, "files": []},
        "shard": {"raised": enospc, "kept": True,
                  "files": ["train-000000.tar", "train-000000.tar.idx"]},
        "shard_closing": {"raised": enospc, "kept": True, "files": []},
        "heartbeat": {"raised": enospc, "kept": True, "files": ["heartbeat_rank0_TS.json"]},
    }  # fmt: skip


def test_a_named_write_failing_not_for_space_raises_its_own_error(tmp_path: Path) -> None:
    target = tmp_path / "a.ckpt"
    atomic_files.write(target, b"old", what="checkpoint")

    def broken(f) -> None:
        f.write(b"half of the new")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        atomic_files.write(target, broken, what="checkpoint")
    assert target.read_bytes() == b"old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.ckpt"]


def test_human_size() -> None:
    assert [human_size(n) for n in (12, 2048, 3 * 2**20, 5 * 2**30)] == [
        "12 B", "2.0 KB", "3.0 MB", "5.00 GB"]  # fmt: skip


def test_space_of_a_path_not_yet_made_is_its_parents(tmp_path: Path) -> None:
    made, later = fs_space(tmp_path), fs_space(tmp_path / "not" / "yet")
    assert made is not None and later is not None and made.total == later.total


def test_disk_full_error_is_found_behind_a_chain() -> None:
    full = OSError(errno.ENOSPC, "No space left on device", "/x/ckpt.tmp")
    try:
        try:
            raise full
        except OSError as e:
            raise RuntimeError("file write failed") from e
    except RuntimeError as outer:
        assert disk_full_error(outer) is full
    assert disk_full_error(RuntimeError("other")) is None
    assert disk_full_error(OSError(errno.EACCES, "denied")) is None


FULL_DISK_SCRIPT = """
import sys
from pathlib import Path
from ae.errors import DiskFullError
from ae import atomic_files
target = Path(sys.argv[1]) / "grid.png"
atomic_files.write(target, b"old", what="sample grid")
try:
    atomic_files.write(target, b"x" * 2 * 2**20, what="sample grid")
except DiskFullError as e:
    files = sorted(p.name for p in target.parent.iterdir())
    print(e.what, e.errno, e.filename, e.free < 2**20, e.total, files, target.read_bytes())
"""


def test_a_named_write_on_a_full_disk_is_disk_full_and_leaves_no_part(
    tmp_path: Path,
) -> None:
    """A real ENOSPC (a 1 MB tmpfs in a private mount namespace): DiskFullError with what was
    written and the figures, no `.tmp` left, the previous file intact."""
    if (problem := namespace_problem()) is not None:
        pytest.skip(problem)
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    res = subprocess.run(
        ["unshare", "-m", "bash", "-c",
         f'mount -t tmpfs -o size=1m tmpfs {mnt} && "{sys.executable}" -c "$SCRIPT" {mnt}'],
        cwd=ROOT, env={**os.environ, "SCRIPT": FULL_DISK_SCRIPT}, capture_output=True, text=True,
        timeout=60,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr
    expected = f"sample grid 28 {mnt}/grid.png True 1048576 ['grid.png'] b'old'"
    assert res.stdout.strip() == expected
