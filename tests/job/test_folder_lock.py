"""One run per output folder: the lock (held by a real second process), its stale leftovers, the
followers of a multi-node job, and the refusal to start afresh over earlier checkpoints."""

from __future__ import annotations

import json
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

from ae.config import parse_config
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
from ae.job.peer_nodes import PeerNodes
from ae.job.same_job import NodesDiffer, check_same_job, job_settings
from ae.job.topology import topology
from ae.run_paths import RunDir
from bench.synthetic_logs import write_heartbeat
from tests.support.runs import ROOT

HOLDER = textwrap.dedent(
    """
    import json, sys, time
    from pathlib import Path
    from ae.job.folder_lock import acquire
    from ae.run_paths import RunDir
    settings = json.loads(sys.argv[3]) if len(sys.argv) > 3 else None
    acquire(RunDir(Path(sys.argv[1])), sys.argv[2], "20261123_101500", settings=settings)
    print("locked", flush=True)
    time.sleep(600)
    """
)


@contextmanager
def holder(
    root: Path, job: str = "SLURM job 7 step 0", settings: dict | None = None
) -> Iterator[subprocess.Popen]:
    """Another process holding the folder's lock (with the job's `settings`: node 0's)."""
    extra = [json.dumps(settings)] if settings is not None else []
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(root), job, *extra], cwd=ROOT, stdout=subprocess.PIPE,
        text=True,
    )  # fmt: skip
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


def test_a_node_started_otherwise_than_node_0_refuses_to_join_and_node_0_hears_it(
    tmp_path: Path,
) -> None:
    """Was: node 1 with NNODES=3 joined node 0's job and its ranks crashed in Lightning's
    `devices=1 and num_nodes=3` check, node 0's ranks waiting in setup until --pg_timeout; with
    another --batch_size the job hung at the first epoch's end of node 1's shorter plan."""
    run_dir = RunDir(tmp_path / "run")
    job = "multi-node job at 10.0.0.1:29500"
    env0 = {"NNODES": "2", "NODE_RANK": "0", "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500"}

    def settings(argv: list[str], **env: str) -> dict | None:
        cfg = parse_config([f"--output_dir={run_dir.root}", *argv])
        return job_settings(cfg, topology(cfg.run, {**env0, **env}), nproc=2)

    # what a node may set on its own: the data's path (checked by the ranks), the console's detail
    first = settings(["--batch_size=32", "--train_shards=/data/a"])
    assert settings(["--batch_size=32", "--train_shards=/mnt/a", "--debug=true"]) == first
    with holder(run_dir.root, job, first):
        # the same command: followed as before
        lock = follow(run_dir, job, timeout=5)
        check_same_job(run_dir, lock, first, node=1)
        with pytest.raises(NodesDiffer) as err:
            check_same_job(run_dir, lock, settings(["--batch_size=64"], NNODES="3", NODE_RANK="1"),
                           node=1)  # fmt: skip
    message = err.value.render()
    assert message.startswith("Node 1 was not started like node 0 (multi-node job at 10.0.0.1:")
    assert "NNODES=3 on node 1, 2 on node 0; --batch_size=64 on node 1, 32 on node 0." in message
    assert "only NODE_RANK differing" in message and err.value.exit_code == 2
    # node 0's launcher, waiting for node 1 to join, hears it once, and stops
    peers = PeerNodes(run_dir.logs, "20261123_101500")
    said = peers.refused()
    assert said is not None and said.startswith("Node 1 (host ")
    assert "will not join this job: started otherwise than node 0: NNODES=3 on node 1" in said
    assert not list(run_dir.root.glob("refused_node*")) and peers.refused() is None
    # a note of another run of the folder is not this run's
    run_dir.refused(1).write_text(json.dumps({"run_ts": "x", "node": 1, "host": "h",
                                              "message": "m"}))  # fmt: skip
    assert PeerNodes(run_dir.logs, "20261123_101500").refused() is None


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
