"""How many processes a node runs, and torchrun over them: what both launchers share.

`ae-train` (`ae.job.launch`) and `ae-encode` (`ae.job.encode`) decide the processes per node the
same way (`processes_per_node`: `--devices`, else every visible GPU, else 2 CPU processes; under
SLURM's one-task-per-process layout, SLURM's count) and name what each rank runs the same way
(`rank_command`). Both start torchrun through `ae.job.torchrun` (TORCHRUN_MODULE), which keeps
torchrun's own words in the run's launcher log and ends it with the launcher; `run_torchrun` is
ae-encode's. No torch here: the GPU count comes from CUDA_VISIBLE_DEVICES or `nvidia-smi -L`.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path

from ae.config import RunConfig
from ae.config.checks import CPU_16_MIXED
from ae.job.supervise import start_child, stop_signals, wait
from ae.job.topology import Topology

CPU_PROCESSES = 2
# torchrun waits this long for every node to join before it starts any rank, then fails. Passed
# to its static rendezvous (`static_nodes`): left to itself, torchrun gives it 900 s
# (`LaunchConfig`'s default, not the static backend's 600); the c10d rendezvous's `join_timeout`
# (`ae.job.elastic`) is the same. docs/CONTRACT.md promises it.
JOIN_TIMEOUT_S = 600
# torchrun, its own output into the run's launcher_<TS>.log, and it dies with the launcher
TORCHRUN_MODULE = "ae.job.torchrun"
# With --debug, the distributed libraries' own debug output, into each rank's native log; unless
# the user set them. Not TORCH_DISTRIBUTED_DEBUG=DETAIL: it checks every collective (slow).
DEBUG_ENV = {"NCCL_DEBUG": "INFO", "TORCH_CPP_LOG_LEVEL": "INFO", "TORCH_DISTRIBUTED_DEBUG": "INFO"}


def rank_command(debug: bool, module: str) -> list[str]:
    """torchrun's arguments naming what each rank runs (`python -m module`). The debug variables
    are set for the ranks only (through `env`): in torchrun's own process they would flood the
    console."""
    debug_env = [f"{k}={v}" for k, v in DEBUG_ENV.items() if debug and k not in os.environ]
    if not debug_env:
        return ["-m", module]
    return ["--no-python", "env", *debug_env, sys.executable, "-u", "-m", module]


def visible_gpus() -> int:
    """GPU count without importing torch (keeps the launcher fast)."""
    if (cvd := os.environ.get("CUDA_VISIBLE_DEVICES")) is not None:
        return len([d for d in cvd.split(",") if d.strip() and d.strip() != "-1"])
    if shutil.which("nvidia-smi") is None:
        return 0
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return 0
    return sum(line.startswith("GPU ") for line in out.stdout.splitlines())


def processes_per_node(
    run: RunConfig, topo: Topology, image_decode: str = "cpu"
) -> tuple[int, list[str]]:
    """Processes to start on this node, and the problems of the flags with this node's GPUs
    (`image_decode`: the data's `--image_decode`, which the GPU decode needs one for)."""
    problems = []
    gpus = visible_gpus() if run.accelerator != "cpu" else 0
    if run.accelerator == "gpu" and gpus == 0:
        problems.append("accelerator: gpu requested but no GPU is visible")
    elif run.precision == "16-mixed" and gpus == 0:
        problems.append(f"precision: {CPU_16_MIXED}")
    if image_decode == "gpu" and gpus == 0 and run.accelerator != "gpu":
        why = "--accelerator=cpu" if run.accelerator == "cpu" else "no GPU is visible"
        problems.append(
            f"image_decode: gpu decodes JPEGs on each rank's GPU, and this run has none ({why}); "
            "use --image_decode=cpu"
        )
    if topo.task is not None:  # SLURM, one task per process: SLURM decided
        n = topo.task.per_node
        if run.devices not in ("auto", str(n)):
            problems.append(
                f"devices: {run.devices} requested, but SLURM starts {n} tasks per node (one "
                f"process each); use --devices=auto or {n}"
            )
        return n, problems
    if run.devices != "auto":
        n = int(run.devices)
        if gpus and run.accelerator != "cpu" and n > gpus:
            problems.append(f"devices: {n} requested but only {gpus} GPU(s) visible")
        return n, problems
    return (gpus if gpus else CPU_PROCESSES), problems


def cpu_cores() -> int:
    """The CPU cores this process may run on: its affinity (taskset, a container's cpuset), not
    the host's count."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # no affinity on this platform (macOS)
        return os.cpu_count() or 1


def shared_cores_note(run: RunConfig, nproc: int) -> str | None:
    """A calm note when this node runs more CPU processes (ranks without a GPU) than it has
    cores: they take turns, and each step waits for the slowest. Not a warning: the run works,
    only slower (a healthy run's train log holds no WARNING); None when each has a core, or the
    ranks run on GPUs."""
    cores = cpu_cores()
    if nproc <= cores or (run.accelerator != "cpu" and visible_gpus()):
        return None
    return (
        f"Note: {nproc} processes share this node's {cores} CPU cores (no GPU): they take turns "
        f"on them, so each step runs slower than on a core each; --devices={cores} gives each "
        "process its own"
    )


def static_nodes(topo: Topology, port: str) -> list[str]:
    """torchrun's arguments for a job of fixed nodes (its static rendezvous at the master),
    waiting JOIN_TIMEOUT_S for all of them."""
    return [
        f"--nnodes={topo.nnodes}", f"--node_rank={topo.node_rank}",
        f"--master_addr={topo.master_addr}", f"--master_port={port}",
        f"--rdzv-conf=timeout={JOIN_TIMEOUT_S}",
    ]  # fmt: skip


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_torchrun(
    command: list[str],
    args: list[str],
    *,
    nproc: int,
    topo: Topology,
    env: dict[str, str],
    launcher_log: Path,
    keep_fds: tuple[int, ...] = (),
    on_stop: str | None = None,
) -> tuple[int, signal.Signals | None]:
    """torchrun for this node over `command` (`rank_command(...)`) with `args`, passing stop
    signals on (ae-encode's launcher), its own output in `launcher_log`; it and its ranks stop
    when this process dies, however it dies. `keep_fds` (the folder's lock) stay open in it.
    `on_stop`: what the ranks do on a stop signal (said on the console). Returns its exit code
    and the stop signal, if any."""
    port = topo.master_port or str(free_port())
    launcher_log.parent.mkdir(parents=True, exist_ok=True)
    cmd = [
        sys.executable, "-m", TORCHRUN_MODULE, str(launcher_log), str(os.getpid()),
        *static_nodes(topo, port), f"--nproc_per_node={nproc}", *command, *args,
    ]  # fmt: skip
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    with stop_signals() as stops:  # before the child starts: `ae.job.supervise`
        proc = start_child(cmd, env, stops, keep_fds)
        if proc is None:  # a stop came before it: no rank to stop
            return 128 + int(stops.first), stops.first  # type: ignore[arg-type]
        rc, stops = wait(proc, on_stop=on_stop, stops=stops)
    return rc, stops.first
