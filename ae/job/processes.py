"""How many processes a node runs, and torchrun over them: what both launchers share.

`ae-train` (`ae.job.launch`) and `ae-encode` (`ae.job.encode`) decide the processes per node the
same way (`processes_per_node`: `--devices`, else every visible GPU, else 2 CPU processes; under
SLURM's one-task-per-process layout, SLURM's count) and name what each rank runs the same way
(`rank_command`). Both start torchrun through `ae.job.torchrun` (TORCHRUN_MODULE), which keeps
torchrun's own words in the run's launcher log and ends it with the launcher; `run_torchrun` is
ae-encode's. One process on one node has nothing for torchrun to coordinate: both start that
rank themselves (`rank_is_child`, `child_rank_env`) and say how it ended in the launcher log
(`note_rank_end`), as torchrun would. No torch here: the GPU count comes from
CUDA_VISIBLE_DEVICES or `nvidia-smi -L`.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path

from ae.config import RunConfig
from ae.config.checks import CPU_16_MIXED
from ae.job.rank_env import LAUNCHER_LOG_ENV, LAUNCHER_PID_ENV
from ae.job.supervise import start_child, stop_signals, wait
from ae.job.topology import Topology
from ae.log_lines import RANK_ENDED

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


def rank_is_child(topo: Topology, nproc: int) -> bool:
    """Whether the launcher starts this node's one rank itself, with no torchrun between them: a
    SLURM task's rank (SLURM started the job's processes), and one process on one node, where
    torchrun has nothing to coordinate and cost the most common run, a single GPU's, ~1.7 s of
    CPU and as much of its start. Restarts stay the launcher's (`ae.job.restarts`)."""
    return topo.task is not None or (topo.nnodes == 1 and nproc == 1)


def child_rank_env(topo: Topology, port: str, launcher_log: Path, debug: bool) -> dict[str, str]:
    """What the rank the launcher starts itself gets in its environment: what torchrun would set
    (from SLURM's variables for a task, as Lightning reads them; else rank 0 of 1), the debug
    variables with `debug`, and what it needs to follow this launcher (`ae.job.rank_env`)."""
    task = topo.task
    env = {
        "RANK": str(task.rank if task else 0), "WORLD_SIZE": str(task.world_size if task else 1),
        "LOCAL_RANK": str(task.local_rank if task else 0),
        "LOCAL_WORLD_SIZE": str(task.per_node if task else 1), "GROUP_RANK": str(topo.node_rank),
        "MASTER_ADDR": topo.master_addr, "MASTER_PORT": str(port),
        LAUNCHER_PID_ENV: str(os.getpid()), LAUNCHER_LOG_ENV: str(launcher_log),
    }  # fmt: skip
    if debug:
        env.update({k: v for k, v in DEBUG_ENV.items() if k not in os.environ})
    return env


def note_rank_end(launcher_log: Path, topo: Topology, pid: int, rc: int) -> int:
    """A rank this launcher started itself ended with `rc` (not 0): what torchrun's report says
    of a rank, in the launcher log, for ae-diagnose (the signal that killed it leaves no line of
    its own). Returns the launcher's code for it: a SLURM task's own; else torchrun's for a
    failed rank, 1, so that the launcher ends the same either way."""
    with contextlib.suppress(OSError), launcher_log.open("a", encoding="utf-8") as f:
        f.write(RANK_ENDED.format(rank=topo.task.rank if topo.task else 0, pid=pid, code=rc) + "\n")
    return rc if topo.task is not None else 1


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(
    module: str,
    debug: bool,
    args: list[str],
    *,
    nproc: int,
    topo: Topology,
    env: dict[str, str],
    launcher_log: Path,
    keep_fds: tuple[int, ...] = (),
    on_stop: str | None = None,
) -> tuple[int, signal.Signals | None]:
    """This node's ranks of `python -m module` with `args` (ae-encode's launcher): torchrun over
    them, its own output in `launcher_log`, or the one rank itself (`rank_is_child`); stop
    signals passed on; they stop when this process dies, however it dies. `keep_fds` (the
    folder's lock) stay open in the child. `on_stop`: what the ranks do on a stop signal (said on
    the console). Returns the exit code and the stop signal, if any."""
    port = topo.master_port or str(free_port())
    launcher_log.parent.mkdir(parents=True, exist_ok=True)
    if child := rank_is_child(topo, nproc):
        cmd = [sys.executable, "-u", "-m", module, *args]
        env.update(child_rank_env(topo, port, launcher_log, debug))
    else:
        cmd = [
            sys.executable, "-m", TORCHRUN_MODULE, str(launcher_log), str(os.getpid()),
            *static_nodes(topo, port), f"--nproc_per_node={nproc}", *rank_command(debug, module),
            *args,
        ]  # fmt: skip
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    with stop_signals() as stops:  # before the child starts: `ae.job.supervise`
        proc = start_child(cmd, env, stops, keep_fds)
        if proc is None:  # a stop came before it: no rank to stop
            return 128 + int(stops.first), stops.first  # type: ignore[arg-type]
        rc, stops = wait(proc, on_stop=on_stop, stops=stops)
    if rc != 0 and child:
        rc = note_rank_end(launcher_log, topo, proc.pid, rc)
    return rc, stops.first
