"""Where this launcher sits in its job: how many nodes, which one it is, where node 0 listens,
and -- under SLURM's one-task-per-process layout -- which rank it is.

Without SLURM: `NNODES`, `NODE_RANK`, `MASTER_ADDR`, `MASTER_PORT` (multi-node runs start one
launcher per node by hand). Under SLURM the job describes itself, in two standard layouts:

(a) one task per node (`srun --ntasks-per-node=1 ./train_ae.sh`, or the batch script of a
    one-node job): torchrun per node, node rank = the task's `SLURM_PROCID`;
(b) one task per process (`srun --ntasks-per-node=G ./train_ae.sh`): every task is one rank of
    ONE job -- `SLURM_PROCID`, `SLURM_STEP_NUM_TASKS`, `SLURM_LOCALID` -- and no torchrun runs,
    as Lightning's SLURM environment does.

Only a job step's variables say what a process is: the batch shell of `sbatch -n2` sees
`SLURM_PROCID=0` and `SLURM_NTASKS=2` but is no task of a step (it has no `SLURM_STEP_ID`).
Multi-node SLURM jobs need no exports: MASTER_ADDR is the first host of the step's node list
(`scontrol show hostnames`), MASTER_PORT comes from the job id. Any other layout (a batch script
on several nodes, uneven tasks per node) fails at once, naming the variables and the layouts.
"""

from __future__ import annotations

import os
import re
import subprocess
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from ae.config import ConfigError, RunConfig

DEFAULT_PORT = "29500"  # torchrun's, for multi-node runs started by hand
SLURM_PORT_BASE = 15000  # + job id % 10000: every node of a job derives the same port


@dataclass(frozen=True)
class TaskRank:
    """This process's rank in SLURM's one-task-per-process layout."""

    rank: int
    world_size: int
    local_rank: int
    per_node: int


@dataclass(frozen=True)
class Topology:
    nnodes: int
    node_rank: int
    master_addr: str
    master_port: str | None  # None: any free port (one node)
    job: str  # names the job in the lock file; the same on every node of the job
    task: TaskRank | None = None  # set in SLURM layout (b): no torchrun, this task is one rank

    @property
    def leader(self) -> bool:
        """The one launcher of the job that takes the run folder's lock and reports."""
        return self.task.rank == 0 if self.task else self.node_rank == 0


def scontrol_hostnames(nodelist: str) -> list[str]:
    out = subprocess.run(
        ["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True, timeout=30
    )
    if out.returncode != 0:
        raise ConfigError([f"MASTER_ADDR: `scontrol show hostnames {nodelist}` failed; set it"])
    return out.stdout.split()


def tasks_per_node(spec: str) -> list[int]:
    """SLURM's `2(x3),1` -> [2, 2, 2, 1]."""
    counts: list[int] = []
    for part in spec.split(","):
        m = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part.strip())
        if m is None:
            return []
        counts += [int(m[1])] * int(m[2] or 1)
    return counts


def _layout_error(what: str) -> ConfigError:
    return ConfigError([
        f"SLURM layout not supported: {what}. Start the launcher in one of the two layouts:",
        "(a) one task per node: srun --ntasks-per-node=1 ./train_ae.sh ... (torchrun on each "
        "node starts --devices processes), or the batch script of a one-node job",
        "(b) one task per process: srun --ntasks-per-node=G ./train_ae.sh ... (G on every node; "
        "each task is one rank of one job)",
    ])  # fmt: skip


def _slurm(env: Mapping[str, str], hostnames: Callable[[str], list[str]]) -> Topology | None:
    job_id = env.get("SLURM_JOB_ID")
    if job_id is None:
        return None
    if "SLURM_STEP_ID" not in env:  # a batch script or salloc shell: runs on the first node only
        nodes = int(env.get("SLURM_JOB_NUM_NODES", env.get("SLURM_NNODES", "1")))
        if nodes > 1:
            raise _layout_error(
                f"the batch script (no SLURM_STEP_ID) runs on the first of SLURM_JOB_NUM_NODES="
                f"{nodes} nodes only"
            )
        return Topology(1, 0, "127.0.0.1", env.get("MASTER_PORT"), f"SLURM job {job_id}")
    step = env["SLURM_STEP_ID"]
    ntasks = int(env.get("SLURM_STEP_NUM_TASKS", env.get("SLURM_NTASKS", "1")))
    nnodes = int(env.get("SLURM_STEP_NUM_NODES", env.get("SLURM_NNODES", "1")))
    per_node_spec = env.get("SLURM_STEP_TASKS_PER_NODE", env.get("SLURM_TASKS_PER_NODE", "1"))
    counts = tasks_per_node(per_node_spec)
    if len(counts) != nnodes or len(set(counts)) != 1 or sum(counts) != ntasks:
        raise _layout_error(
            f"SLURM_STEP_NUM_TASKS={ntasks} on SLURM_STEP_NUM_NODES={nnodes} "
            f"(SLURM_STEP_TASKS_PER_NODE={per_node_spec}): not the same number on every node"
        )
    per_node = counts[0]
    procid = int(env.get("SLURM_PROCID", "0"))
    job = f"SLURM job {job_id} step {step}"
    port = env.get("MASTER_PORT")
    addr = env.get("MASTER_ADDR", "127.0.0.1")
    if nnodes > 1 or per_node > 1:
        port = port or str(SLURM_PORT_BASE + int(job_id) % 10000)
    if nnodes > 1 and "MASTER_ADDR" not in env:
        nodelist = env.get("SLURM_STEP_NODELIST", env.get("SLURM_JOB_NODELIST", ""))
        addr = hostnames(nodelist)[0]
    if per_node == 1:  # (a): task i runs on node i of the step
        return Topology(nnodes, procid, addr, port, job)
    task = TaskRank(procid, ntasks, int(env.get("SLURM_LOCALID", "0")), per_node)
    return Topology(nnodes, int(env.get("SLURM_NODEID", "0")), addr, port, job, task)


def topology(
    run: RunConfig,
    env: Mapping[str, str] = os.environ,
    hostnames: Callable[[str], list[str]] = scontrol_hostnames,
) -> Topology:
    """This launcher's place in its job; ConfigError for what cannot work."""
    if (found := _slurm(env, hostnames)) is not None:
        return found
    nnodes = int(env.get("NNODES", run.num_nodes))
    node_rank = int(env.get("NODE_RANK", 0))
    problems = []
    if nnodes > 1 and "MASTER_ADDR" not in env:
        problems.append("MASTER_ADDR: must be set (to node 0's address) for a multi-node run")
    if not 0 <= node_rank < nnodes:
        problems.append(f"NODE_RANK: must be in [0, {nnodes}); got {node_rank}")
    if problems:
        raise ConfigError(problems)
    addr = env.get("MASTER_ADDR", "127.0.0.1")
    port = env.get("MASTER_PORT") or (DEFAULT_PORT if nnodes > 1 else None)
    job = "local job" if nnodes == 1 else f"multi-node job at {addr}:{port}"
    return Topology(nnodes, node_rank, addr, port, job)
