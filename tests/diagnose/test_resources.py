"""ae-diagnose names the resource that ran out, on synthetic logs and recorded heartbeat figures:
`disk full`, `shared memory exhausted`, `out of memory (OOM killer)`, `too many open files`.
The real runs are tests/e2e/test_resources.py (a real OOM kill where a memory cgroup can be
made; the OOM rules here are the rule tested on recorded heartbeat evidence)."""

from __future__ import annotations

from pathlib import Path

from ae.log_lines import DISK_FULL
from bench.synthetic_logs import write_heartbeat
from tests.diagnose.synthetic_runs import (
    BACKWARD_FRAMES,
    GLOO,
    culprits,
    dead_pid,
    run_diagnose,
    writers,
)

WORKER_FRAMES = [
    ("/x/torch/utils/data/dataloader.py", "_next_data"),
    ("/x/torch/utils/data/dataloader.py", "_try_get_data"),
]


def worker_failure(logs: Path, exc_type: str, message: str, resources: dict) -> dict:
    """The diagnosis of a run whose rank 0 failed in data loading with `exc_type: message`, its
    last heartbeat (`state: failed`) with `resources`."""
    w0, w1 = writers(logs)
    w0.fatal(exc_type, message, WORKER_FRAMES)
    write_heartbeat(logs, 0, 2, pid=dead_pid(), t=w0.t, phase="data loading", step=3,
                    state="failed", resources=resources)  # fmt: skip
    w0.flush()
    w1.flush()
    return run_diagnose(logs)


def texts(doc: dict) -> list[str]:
    return [e["text"] for e in doc["culprits"][0]["evidence"]]


def test_disk_full_from_the_error_line_with_the_disk_figures(tmp_path: Path) -> None:
    w0, w1 = writers(tmp_path)
    w0.steps(1, 4)
    w0.log(
        DISK_FULL.format(
            what="checkpoint",
            path="/o/checkpoints/step-00000004.ckpt",
            free="0 B",
            total="160.0 MB",
            fix="free space",
        ),
        "ERROR",
    )
    w0.exit(28, "disk full")
    write_heartbeat(
        tmp_path,
        0,
        2,
        pid=dead_pid(),
        t=w0.t,
        phase="checkpoint save",
        step=4,
        state="exited",
        resources={"disk_free_mb": 2.0, "disk_total_mb": 160.0},
    )
    w1.fatal("RuntimeError", GLOO, BACKWARD_FRAMES)
    w0.flush()
    w1.flush()
    doc = run_diagnose(tmp_path)
    assert culprits(doc) == [(0, "checkpoint save", "disk full")]
    assert "was: error exit: disk full" in doc["culprits"][0]["rule"]
    assert texts(doc)[-1] == "heartbeat: output folder disk 2.0 MB free of 160.0 MB"


def test_enospc_in_shared_memory_is_shm_not_disk(tmp_path: Path) -> None:
    message = "unable to write to file </torch_123_456_0>: No space left on device (28)"
    doc = worker_failure(
        tmp_path, "RuntimeError", message, {"shm_free_mb": 0.0, "shm_total_mb": 64.0}
    )
    assert culprits(doc) == [(0, "data loading", "shared memory exhausted")]
    assert texts(doc)[-1] == "heartbeat: /dev/shm 0.0 MB free of 64.0 MB"


def test_a_worker_bus_error_is_shm_only_when_shm_was_near_full(tmp_path: Path) -> None:
    message = (
        "DataLoader worker (pid 77) is killed by signal: Bus error. It is possible that "
        "dataloader's workers are out of shared memory."
    )
    for shm_free, cause in ((1.0, "shared memory exhausted"), (60.0, "exception: RuntimeError")):
        resources = {"shm_free_mb": shm_free, "shm_total_mb": 64.0}
        doc = worker_failure(tmp_path / str(shm_free), "RuntimeError", message, resources)
        assert culprits(doc) == [(0, "data loading", cause)]


def test_stuck_in_data_loading_with_shm_full(tmp_path: Path) -> None:
    w0, w1 = writers(tmp_path)
    w0.stall("data loading", 3, 31.0)
    w1.stall("training step", 3, 31.0, collective="yes (DDP gradient all-reduce in backward)")
    for w in (w0, w1):
        write_heartbeat(
            tmp_path,
            w.rank,
            2,
            pid=dead_pid(),
            t=w.t,
            phase="data loading",
            step=3,
            stalled=True,
            resources={"shm_free_mb": 0.5, "shm_total_mb": 64.0},
        )
        w.flush()
    doc = run_diagnose(tmp_path)
    assert culprits(doc) == [(0, "data loading", "shared memory exhausted")]
    assert "stuck in data loading while /dev/shm was near full" in doc["culprits"][0]["rule"]


def test_killed_rank_is_oom_by_cgroup_count_or_host_memory(tmp_path: Path) -> None:
    """Rank 0's log just stops (SIGKILL): the OOM killer when its cgroup's count rose or host
    memory was near zero in its last heartbeat; `killed without trace` otherwise."""
    cases = {
        "cgroup": ({"oom_kills": 3, "oom_kills_at_start": 2}, "out of memory (OOM killer)"),
        "host": ({"mem_available_mb": 90.0, "mem_total_mb": 64000.0}, "out of memory (OOM killer)"),
        "neither": ({}, "killed without trace"),
    }
    for name, (resources, cause) in cases.items():
        logs = tmp_path / name
        w0, w1 = writers(logs)
        for w in (w0, w1):
            w.steps(1, 5)
        write_heartbeat(
            logs, 0, 2, pid=dead_pid(), t=w0.t, phase="training step", step=5, resources=resources
        )
        w1.steps(6, 6)
        w1.fatal("RuntimeError", GLOO, BACKWARD_FRAMES)
        w0.flush()
        w1.flush()
        doc = run_diagnose(logs)
        assert culprits(doc) == [(0, "training step", cause)], name
    assert "heartbeat: cgroup OOM kills 2 -> 3" in texts(run_diagnose(tmp_path / "cgroup"))[-1]
    assert "host memory near zero: 90 MB" in texts(run_diagnose(tmp_path / "host"))[-1]


def test_a_worker_killed_while_handing_a_batch_over_is_oom_by_cgroup_count(
    tmp_path: Path,
) -> None:
    """The OOM killer took rank 0's worker while the rank fetched a batch's descriptor from it:
    the rank's EOFError, no `killed by signal` line. OOM with the cgroup's count risen; without
    it, the exception it is."""
    for name, kills, cause in (("oom", 3, "out of memory (OOM killer)"),
                               ("none", 2, "exception: EOFError")):  # fmt: skip
        resources = {"oom_kills": kills, "oom_kills_at_start": 2}
        doc = worker_failure(tmp_path / name, "EOFError", "", resources)
        assert culprits(doc) == [(0, "data loading", cause)]


def test_too_many_open_files(tmp_path: Path) -> None:
    message = "[Errno 24] Too many open files: '/d/train-000007.tar'"
    doc = worker_failure(tmp_path, "OSError", message, {"open_fds": 1021, "fd_limit": 1024})
    assert culprits(doc) == [(0, "data loading", "too many open files")]
    assert texts(doc)[-1] == "heartbeat: 1021 open fds, ulimit -n 1024"
