"""One run per output folder: the lock (held by a real second process), its stale leftovers, the
followers of a multi-node job, and the refusal to start afresh over earlier checkpoints."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import psutil
import pytest

from ae.job import folder_lock
from ae.job.folder_lock import (
    EarlierCheckpoints,
    LeaderMissing,
    OtherRunsCheckpoints,
    RunFolderBusy,
    acquire,
    earlier_checkpoints,
    follow,
    read_lock,
    unused_run_ts,
)
from ae.run_paths import RunDir
from bench.synthetic_logs import write_heartbeat
from tests.support.runs import ROOT

HOLDER = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path
    from ae.job.folder_lock import acquire
    from ae.run_paths import RunDir
    acquire(RunDir(Path(sys.argv[1])), sys.argv[2], "20261123_101500")
    print("locked", flush=True)
    time.sleep(600)
    """
)


@contextmanager
def holder(root: Path, job: str = "SLURM job 7 step 0") -> Iterator[subprocess.Popen]:
    """Another process holding the folder's lock."""
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(root), job], cwd=ROOT, stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline() == "locked\n"
        yield proc
    finally:
        proc.kill()
        proc.wait(timeout=30)


def test_a_second_run_fails_at_once_naming_the_job_in_the_way(tmp_path: Path) -> None:
    run_dir = RunDir(tmp_path / "run")
    with holder(run_dir.root) as proc:
        t0 = time.monotonic()
        with pytest.raises(RunFolderBusy) as err:
            acquire(run_dir, "local job", "20261123_101600")
        assert time.monotonic() - t0 < 1.0  # a live holder on this host: no retrying
        message = err.value.render()
        assert f"{run_dir.root} is in use by another run: SLURM job 7 step 0 (pid {proc.pid}" in (
            message
        )
        assert "run 20261123_101500, started 20" in message and "another --output_dir" in message
        # a launcher of another job's second node fails as fast
        with pytest.raises(RunFolderBusy):
            follow(run_dir, "SLURM job 8 step 0", timeout=5)


def test_the_lock_of_a_killed_launcher_is_taken_over(tmp_path: Path) -> None:
    run_dir = RunDir(tmp_path / "run")
    with holder(run_dir.root) as proc:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    stale = read_lock(run_dir.lock)
    assert stale is not None and stale.pid == proc.pid and stale.gone()
    lock = acquire(run_dir, "local job", "20261123_101600")
    assert lock.taken_over == stale
    assert read_lock(run_dir.lock) == lock.info and lock.info.pid == os.getpid()
    lock.release()
    assert not run_dir.lock.exists()  # released on exit: nothing left behind


def test_followers_adopt_the_leaders_run_ts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, records: list[tuple[str, str]]
) -> None:
    run_dir = RunDir(tmp_path / "run")
    with holder(run_dir.root, "SLURM job 7 step 0"):
        info = follow(run_dir, "SLURM job 7 step 0", timeout=5)
        assert info.run_ts == "20261123_101500"
    monkeypatch.setattr(folder_lock, "FOLLOW_POLL_S", 0.05)
    monkeypatch.setattr(folder_lock, "FOLLOW_TELL_S", 0.1)
    with pytest.raises(LeaderMissing, match=r"did not take the lock .* within 0s: it was not st"):
        follow(run_dir, "SLURM job 7 step 0", timeout=0.2)  # its lock file is stale
    # Was: two minutes of silence before that message, on a node started before the first
    assert [m for _, m in records if m.startswith("Waiting for the first node's launcher")]


def test_a_fresh_run_refuses_earlier_checkpoints(tmp_path: Path) -> None:
    run_dir = RunDir(tmp_path / "run")
    assert earlier_checkpoints(run_dir, None, overwrite=False) == []  # a new folder
    run_dir.checkpoints.mkdir(parents=True)
    for name in ("step-00000004.ckpt", "last.ckpt", "best.ckpt"):
        (run_dir.checkpoints / name).write_bytes(b"x")
    with pytest.raises(EarlierCheckpoints) as err:
        earlier_checkpoints(run_dir, None, overwrite=False)
    message = err.value.render()
    assert "holds checkpoints of an earlier run: best.ckpt, last.ckpt, step-00000004.ckpt" in (
        message
    )
    assert "--resume_from_checkpoint=last" in message and "--overwrite=true" in message
    assert earlier_checkpoints(run_dir, "last", overwrite=False) == []  # a resume reads them
    removed = earlier_checkpoints(run_dir, None, overwrite=True)
    assert len(removed) == 3 and not list(run_dir.checkpoints.iterdir())


def test_a_resume_from_another_folder_refuses_this_folders_checkpoints(tmp_path: Path) -> None:
    # Was: run A's checkpoint resumed into run B's folder replaced B's last.ckpt and best.ckpt
    # and pruned B's step checkpoints, without a word (found by the overnight walkthrough)
    other = tmp_path / "a" / "checkpoints" / "step-00000045.ckpt"
    other.parent.mkdir(parents=True)
    other.write_bytes(b"x")
    run_dir = RunDir(tmp_path / "b")
    assert earlier_checkpoints(run_dir, str(other), overwrite=False) == []  # B has none: fine
    run_dir.checkpoints.mkdir(parents=True)
    for name in ("step-00000063.ckpt", "last.ckpt", "best.ckpt"):
        (run_dir.checkpoints / name).write_bytes(b"x")
    with pytest.raises(OtherRunsCheckpoints) as err:
        earlier_checkpoints(run_dir, str(other), overwrite=False)
    message = err.value.render()
    assert f"{run_dir.checkpoints} holds checkpoints of its own: best.ckpt, last.ckpt" in message
    assert "--resume_from_checkpoint=last" in message
    assert len(list(run_dir.checkpoints.iterdir())) == 3  # nothing deleted
    # A checkpoint of this folder, by any spelling of its path, continues its run
    own = run_dir.checkpoints / "step-00000063.ckpt"
    assert earlier_checkpoints(run_dir, str(own), overwrite=False) == []
    rel = os.path.relpath(own, Path.cwd())
    assert earlier_checkpoints(run_dir, rel, overwrite=False) == []


def test_a_run_in_the_same_second_gets_the_next_ts(tmp_path: Path) -> None:
    assert unused_run_ts(tmp_path / "none", "20261123_101559") == "20261123_101559"
    (tmp_path / "train_20261123_101559.log").write_text("")
    (tmp_path / "launcher_20261123_101600.log").write_text("")
    assert unused_run_ts(tmp_path, "20261123_101559") == "20261123_101601"


def _read_only_mounts() -> bool:
    """Whether this machine lets a user namespace mount a read-only tmpfs (root bypasses file
    modes, so a read-only filesystem is the way to make a folder no one can write)."""
    probe = subprocess.run(["unshare", "-rm", "true"], capture_output=True, check=False)
    return probe.returncode == 0


@pytest.mark.skipif(not _read_only_mounts(), reason="needs `unshare -rm` (user namespaces)")
@pytest.mark.parametrize("sub", ["", "run"], ids=["the_folder", "a_folder_inside"])
def test_a_read_only_output_dir_is_one_message_naming_the_folder(tmp_path: Path, sub: str) -> None:
    """The launcher on a read-only --output_dir (or one to create inside a read-only folder):
    exit 2, one message naming the folder, no traceback."""
    ro = tmp_path / "ro"
    ro.mkdir()
    out = ro / sub if sub else ro
    script = (
        f"mount -t tmpfs -o ro tmpfs {ro} && exec {sys.executable} -m ae.cli.launch "
        f"--output_dir={out} --max_epochs=1"
    )
    done = subprocess.run(
        ["unshare", "-rm", "sh", "-c", script], cwd=ROOT, capture_output=True, text=True,
        timeout=120,
    )  # fmt: skip
    said = done.stdout + done.stderr
    assert done.returncode == 2, said
    assert f"--output_dir={out} cannot be written (Read-only file system" in said
    assert "Traceback" not in said and "OSError" not in said


HOLDER_WITH_CHILD = textwrap.dedent(
    """
    import subprocess, sys, time
    from pathlib import Path
    from ae.job.folder_lock import acquire
    from ae.run_paths import RunDir
    lock = acquire(RunDir(Path(sys.argv[1])), "local job", "20261123_101500")
    child = subprocess.Popen(["sleep", "600"], pass_fds=lock.descriptors())
    print(child.pid, flush=True)
    time.sleep(600)
    """
)


def test_a_killed_launchers_child_keeps_the_folder_locked(tmp_path: Path) -> None:
    """The launcher's child inherits the lock's descriptor: the launcher SIGKILLed, the folder
    stays locked (no takeover) until the child is gone too, and the refusal says so."""
    run_dir = RunDir(tmp_path / "run")
    launcher = subprocess.Popen(
        [sys.executable, "-c", HOLDER_WITH_CHILD, str(run_dir.root)], cwd=ROOT,
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    assert launcher.stdout is not None
    child = int(launcher.stdout.readline())
    try:
        launcher.kill()
        # Not reaped yet (a zombie, as under a shell that has not waited): gone all the same
        while psutil.Process(launcher.pid).status() != psutil.STATUS_ZOMBIE:
            time.sleep(0.01)
        with pytest.raises(RunFolderBusy) as err:
            acquire(run_dir, "local job", "20261123_101600")
        assert "its launcher is gone, but the processes it started still hold" in err.value.render()
        launcher.wait(timeout=30)
        with pytest.raises(RunFolderBusy) as err:
            acquire(run_dir, "local job", "20261123_101600")
        assert f"(pid {launcher.pid} on " in err.value.render()
        assert "its launcher is gone, but the processes it started still hold" in err.value.render()
    finally:
        os.kill(child, signal.SIGKILL)
    time.sleep(0.2)  # the child reaped by init
    lock = acquire(run_dir, "local job", "20261123_101600")
    assert lock.taken_over is not None and lock.taken_over.pid == launcher.pid
    lock.release()


def test_a_live_rank_of_a_run_in_the_folder_blocks_a_takeover(tmp_path: Path) -> None:
    """No process holds the lock, but a rank of the folder's run lives (its heartbeat's pid):
    no takeover; the refusal names the rank."""
    run_dir = RunDir(tmp_path / "run")
    run_dir.logs.mkdir(parents=True)
    rank = subprocess.Popen(["sleep", "600"])
    try:
        time.sleep(0.1)
        write_heartbeat(run_dir.logs, 1, 2, pid=rank.pid, t=time.time(), phase="training step",
                        step=5, ts="20261123_101500")  # fmt: skip
        with pytest.raises(RunFolderBusy) as err:
            acquire(run_dir, "local job", "20261123_101600")
        assert f"a job whose ranks still run: rank 1 (pid {rank.pid}, run 20261123_101500)" in (
            err.value.render()
        )
    finally:
        rank.kill()
        rank.wait()
    acquire(run_dir, "local job", "20261123_101600").release()  # gone: free
