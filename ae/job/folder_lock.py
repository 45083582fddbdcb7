"""One run per output folder: the lock of the job that runs in it, and the refusal to start a
fresh run over an earlier run's checkpoints.

The lock is `<output_dir>/run.lock` (`RunDir.lock`), held with `flock` by one job, training or
ae-encode's (`kind`; ae-encode's OUT_DIR is such a folder too): the launcher
of the first node (or of SLURM task 0) takes it, and its child (torchrun) inherits the
descriptor. It holds the launcher's host, pid, run TS, start time and job, so a second launch
fails within seconds naming the job in the way. The kernel drops a `flock` when the last
descriptor of it closes, however its processes die: a killed launcher's job keeps the folder
until its torchrun, which follows the launcher (`ae.job.torchrun`), is gone; then the file is
stale, and the next launch takes it over (and says so) -- unless a rank of a run in the folder
still lives on this host (`live_ranks`, by the heartbeats). The launchers of the other
nodes (or tasks) never take it: they wait until the file names their own job and adopt its run
TS, so the job's ranks all log under one TS; they fail at once when another job holds it.

On NFS, Linux implements `flock` with the server's byte-range locks: it works across nodes when
the filesystem has locking (NFSv4, or NFSv3 with lockd); a lock whose node crashed is freed when
the server's lease runs out (about 90 s). On a filesystem without locks (`-o nolock`) `flock`
fails with ENOLCK: then the file's contents alone decide (a holder on this host whose process is
gone is stale; one on another host cannot be checked, and the message names the file to remove).
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import psutil
from loguru import logger

from ae import atomic_files
from ae.diagnose.heartbeats import Heartbeat, read_heartbeat
from ae.errors import UserError
from ae.log_lines import HEARTBEAT_FILE
from ae.run_paths import RunDir

LOCK_RETRY_S = 2.0  # a follower probing the lock holds it (shared) for a moment
FOLLOW_TIMEOUT_S = 120.0  # NFS may show a new file to other nodes only after its cache timeout
FOLLOW_POLL_S = 0.2
FOLLOW_TELL_S = 10.0  # a follower waiting this long says what it waits for
CHECKPOINTS_LISTED = 5
LOCK_FILE_MAX = 1 << 16  # the lock file with its settings: a few KB
TRAINING, ENCODING = "training", "encoding"  # the jobs that hold a folder: what LockInfo.kind says


@dataclass(frozen=True)
class LockInfo:
    host: str
    pid: int
    run_ts: str
    started: str
    job: str
    kind: str = TRAINING  # lock files written before ae-encode took one were training's
    # What every node of the job must run alike (NNODES, the flags): the other nodes' launchers
    # compare theirs with it (`follow`). None: ae-encode's, or a file written before it.
    settings: dict[str, Any] | None = None

    def describe(self) -> str:
        job = self.job if self.kind == TRAINING else f"ae-encode, {self.job}"
        return f"{job} (pid {self.pid} on {self.host}, run {self.run_ts}, started {self.started})"

    def gone(self) -> bool:
        """Its process is gone (decidable on this host only)."""
        return self.host == socket.gethostname() and not _running(self.pid)

    def alive_here(self) -> bool:
        return self.host == socket.gethostname() and _running(self.pid)


def _running(pid: int) -> bool:
    """The process exists and is not a zombie: a launcher killed a moment ago stays one until
    its parent (the user's shell) reaps it, and is gone all the same."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def read_lock(path: Path) -> LockInfo | None:
    """The lock file's holder, or None (no file, or not written yet)."""
    try:
        return LockInfo(**json.loads(path.read_text()))
    except (OSError, ValueError, TypeError):
        return None


class RunFolderBusy(UserError):
    def __init__(
        self, run_dir: RunDir, holder: LockInfo | None, live: list[Heartbeat] | None = None,
        kind: str = TRAINING,
    ) -> None:  # fmt: skip
        who = holder.describe() if holder else "a job whose lock file is not written yet"
        if live:
            who = f"a job whose ranks still run: {', '.join(_rank_process(h) for h in live)}"
            if holder is not None and holder.gone():
                who += "; its launcher is gone: they save a checkpoint and stop on their own"
        elif holder is not None and holder.gone():
            who += (
                "; its launcher is gone, but the processes it started still hold the folder "
                "(they save a checkpoint and stop on their own)"
            )
        elsewhere = "train into another --output_dir" if kind == TRAINING else (
            "encode into another OUT_DIR"
        )  # fmt: skip
        super().__init__(
            f"{run_dir.root} is in use by another run: {who}.\n"
            f"  Wait for it to end, stop it, or {elsewhere} (one run per folder: {run_dir.lock})."
        )


def _rank_process(h: Heartbeat) -> str:
    run_ts = "_".join(h.path.stem.split("_")[-2:])  # heartbeat_rank<R>_<TS>.json
    return f"rank {h.rank} (pid {h.pid}, run {run_ts})"


def live_ranks(logs: Path) -> list[Heartbeat]:
    """The rank processes of this folder's runs that live on this host (by their heartbeat's
    pid, not reused since): a job whose launcher and torchrun are gone may still have ranks."""
    found = (read_heartbeat(p) for p in sorted(logs.glob(HEARTBEAT_FILE.format(rank="*", ts="*"))))
    return [h for h in found if h is not None and h.alive]


def _listed(found: list[Path]) -> str:
    """`a.ckpt, b.ckpt and 3 more`: the first CHECKPOINTS_LISTED file names."""
    names = ", ".join(p.name for p in found[:CHECKPOINTS_LISTED])
    more = len(found) - CHECKPOINTS_LISTED
    return f"{names} and {more} more" if more > 0 else names


class EarlierCheckpoints(UserError):
    def __init__(self, run_dir: RunDir, found: list[Path]) -> None:
        super().__init__(
            f"{run_dir.checkpoints} holds checkpoints of an earlier run: {_listed(found)}.\n"
            f"  To continue that run: --resume_from_checkpoint=last\n"
            f"  To start afresh: another --output_dir, or --overwrite=true (deletes those "
            f"checkpoints; logs are kept)"
        )


class OtherRunsCheckpoints(UserError):
    def __init__(self, run_dir: RunDir, resume: str, found: list[Path]) -> None:
        super().__init__(
            f"--resume_from_checkpoint={resume} is not of this folder's run, and "
            f"{run_dir.checkpoints} holds checkpoints of its own: {_listed(found)}. Resuming "
            f"here would replace its last.ckpt and best.ckpt and prune its step checkpoints.\n"
            f"  To continue this folder's run: --resume_from_checkpoint=last\n"
            f"  To continue {resume}: an --output_dir without checkpoints (or its own run's)"
        )


class RunFolderUnwritable(UserError):
    def __init__(self, run_dir: RunDir, error: OSError) -> None:
        super().__init__(
            f"--output_dir={run_dir.root} cannot be written ({error.strerror}: "
            f"{error.filename or run_dir.root}).\n"
            f"  The run folder holds the run's lock, logs and checkpoints: train into a folder "
            f"you can write (another --output_dir), or make this one writable."
        )


class LeaderMissing(UserError):
    def __init__(self, run_dir: RunDir, job: str, waited: float) -> None:
        super().__init__(
            f"{job}: the launcher of the first node (NODE_RANK=0, SLURM task 0) did not take "
            f"the lock of {run_dir.root} within {waited:.0f}s: it was not started (start it "
            f"with the same NNODES, MASTER_ADDR, MASTER_PORT and --output_dir), it failed (see "
            f"its output), or the folder is not on a filesystem that every node shares."
        )


class RunLock:
    """The lock held by this process; `release()` removes the file and unlocks."""

    def __init__(self, path: Path, fd: int | None, info: LockInfo, taken_over: LockInfo | None):
        self.path, self.fd, self.info, self.taken_over = path, fd, info, taken_over

    def descriptors(self) -> tuple[int, ...]:
        """The descriptor holding the flock, for a child to inherit: the lock then stays held
        until every process holding it has closed it or died (none without kernel locks)."""
        return () if self.fd is None else (self.fd,)

    def release(self) -> None:
        if self.fd is None and read_lock(self.path) != self.info:
            return  # without kernel locks: not ours any more
        try:
            if self.fd is None or os.stat(self.path).st_ino == os.fstat(self.fd).st_ino:
                self.path.unlink()
        except FileNotFoundError:
            pass
        if self.fd is not None:
            os.close(self.fd)  # closing the descriptor drops the flock
            self.fd = None


def _write(fd: int, info: LockInfo) -> None:
    os.ftruncate(fd, 0)
    os.pwrite(fd, json.dumps(asdict(info)).encode(), 0)
    os.fsync(fd)


def _read_fd(fd: int) -> LockInfo | None:
    try:
        return LockInfo(**json.loads(os.pread(fd, LOCK_FILE_MAX, 0)))
    except (ValueError, TypeError):
        return None


def acquire(
    run_dir: RunDir,
    job: str,
    run_ts: str,
    kind: str = TRAINING,
    settings: dict[str, Any] | None = None,
) -> RunLock:
    """Take the folder's lock for `job` (a `kind` of job), or raise RunFolderBusy naming the job
    that holds it (RunFolderUnwritable when the folder cannot be made or written). `settings`:
    what the other nodes must run alike (`follow`)."""
    try:
        run_dir.root.mkdir(parents=True, exist_ok=True)
        os.close(os.open(run_dir.lock, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644))
    except OSError as e:  # read-only filesystem, no permission, a file in the way
        raise RunFolderUnwritable(run_dir, e) from None
    path = run_dir.lock
    if settings is not None:  # as it reads back (tuples as lists): `release` compares
        settings = json.loads(json.dumps(settings))
    info = LockInfo(
        socket.gethostname(), os.getpid(), run_ts, time.strftime("%Y-%m-%d %H:%M:%S"), job, kind,
        settings,
    )  # fmt: skip
    deadline = time.monotonic() + LOCK_RETRY_S
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            holder = read_lock(path)
            # A live holder on this host: busy. Else it may be a follower's probe: try again.
            if time.monotonic() > deadline or (holder is not None and holder.alive_here()):
                raise RunFolderBusy(run_dir, holder, kind=kind) from None
            time.sleep(0.1)
            continue
        except OSError as e:
            os.close(fd)
            if e.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS):
                raise
            return _acquire_without_locks(run_dir, info)
        try:
            same_file = os.stat(path).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:
            same_file = False
        if not same_file:  # the previous holder removed it between our open and our lock
            os.close(fd)
            continue
        previous = _read_fd(fd)  # a holder that never released it: killed
        if live := live_ranks(run_dir.logs):  # its ranks outlived every holder of the lock
            os.close(fd)
            raise RunFolderBusy(run_dir, previous, live, kind)
        _write(fd, info)
        return RunLock(path, fd, info, previous)


def _acquire_without_locks(run_dir: RunDir, info: LockInfo) -> RunLock:
    logger.warning(f"{run_dir.root}: this filesystem has no file locks; {run_dir.lock} decides")
    holder = read_lock(run_dir.lock)
    if holder is not None and not holder.gone():
        raise RunFolderBusy(run_dir, holder, kind=info.kind)
    if live := live_ranks(run_dir.logs):
        raise RunFolderBusy(run_dir, holder, live, info.kind)
    atomic_files.write(run_dir.lock, json.dumps(asdict(info)).encode())  # read whole or not
    return RunLock(run_dir.lock, None, info, holder)


def lock_held(path: Path) -> bool:
    """Whether a process holds the lock now (a shared lock taken for a moment tells)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    except OSError:  # no locks here: the contents decide
        holder = read_lock(path)
        return holder is not None and not holder.gone()
    finally:
        os.close(fd)  # also drops the shared lock
    return False


def follow(
    run_dir: RunDir, job: str, timeout: float = FOLLOW_TIMEOUT_S, kind: str = TRAINING
) -> LockInfo:
    """For the launchers that do not hold the lock: wait until it names `job` (of `kind`), and
    return it
    (its run TS is the job's). Raise at once when another live job holds it. A file that no one
    holds is stale (its job's launcher was killed): wait for the leader to take it over."""
    start = time.monotonic()
    deadline = start + timeout
    told = False
    while True:
        holder = read_lock(run_dir.lock)
        if holder is not None and lock_held(run_dir.lock):
            if holder.job == job and holder.kind == kind:
                return holder
            raise RunFolderBusy(run_dir, holder, kind=kind)
        if time.monotonic() > deadline:
            raise LeaderMissing(run_dir, job, timeout)
        # Else a node started well before the first one says nothing for two minutes; not at
        # once, as the nodes of one job (every task, in SLURM) usually start within seconds.
        if not told and time.monotonic() - start >= FOLLOW_TELL_S:
            told = True
            logger.info(
                f"Waiting for the first node's launcher (NODE_RANK=0) to take the lock of "
                f"{run_dir.root} (up to {timeout:.0f} s)"
            )
        time.sleep(FOLLOW_POLL_S)


def earlier_checkpoints(run_dir: RunDir, resume: str | None, overwrite: bool) -> list[Path]:
    """A fresh run (no resume) refuses to start over an earlier run's checkpoints: their steps
    would mix with its own in `last.ckpt` and the rotation. With `overwrite` they are deleted
    (and returned). A resume from a checkpoint of another folder refuses them too: it would
    replace them without a word (`--overwrite` and a resume are refused together)."""
    foreign = resume is not None and resume != "last" and not _of_folder(run_dir, resume)
    if foreign and (found := sorted(run_dir.checkpoints.glob("*.ckpt"))):
        raise OtherRunsCheckpoints(run_dir, str(resume), found)
    found = sorted(run_dir.checkpoints.glob("*.ckpt")) if resume is None else []
    if found and not overwrite:
        raise EarlierCheckpoints(run_dir, found)
    for path in found:
        path.unlink(missing_ok=True)
    return found


def _of_folder(run_dir: RunDir, checkpoint: str) -> bool:
    """Whether the checkpoint file lies in the run folder's checkpoints folder."""
    return Path(checkpoint).expanduser().resolve().parent == run_dir.checkpoints.resolve()


def unused_run_ts(logs_dir: Path, ts: str) -> str:
    """`ts`, or the next second that no file in `logs_dir` carries yet (a run started within
    the same second as the previous one must not append to its logs)."""
    t = time.mktime(time.strptime(ts, "%Y%m%d_%H%M%S"))
    while logs_dir.is_dir() and any(logs_dir.glob(f"*_{ts}.*")):
        t += 1
        ts = time.strftime("%Y%m%d_%H%M%S", time.localtime(t))
    return ts
