"""The job's layout from the environment: by hand, and SLURM's variables as a job step, a batch
script, and the layouts that cannot work (the environments as SLURM 22.05 sets them; layouts of
more than one node cannot run on one machine, so their variables are given here)."""

from __future__ import annotations

import pytest

from ae.config import ConfigError, RunConfig
from ae.job.topology import TaskRank, Topology, tasks_per_node, topology

JOB = {"SLURM_JOB_ID": "123", "SLURM_JOB_NODELIST": "gpu[07-08]", "SLURM_NNODES": "2"}


def step(tasks: int, nodes: int, per_node: str, procid: int, localid: int = 0, nodeid: int = 0):
    return {
        **JOB, "SLURM_STEP_ID": "0", "SLURM_STEP_NUM_TASKS": str(tasks),
        "SLURM_STEP_NUM_NODES": str(nodes), "SLURM_STEP_TASKS_PER_NODE": per_node,
        "SLURM_STEP_NODELIST": "gpu[07-08]" if nodes > 1 else "gpu07",
        "SLURM_PROCID": str(procid), "SLURM_LOCALID": str(localid), "SLURM_NODEID": str(nodeid),
        "SLURM_NTASKS": str(tasks),
    }  # fmt: skip


def hostnames(nodelist: str) -> list[str]:
    assert nodelist == "gpu[07-08]"  # the step's node list, as `scontrol show hostnames` reads it
    return ["gpu07", "gpu08"]


def layout(env: dict[str, str]) -> Topology:
    return topology(RunConfig(), env, hostnames)


def test_by_hand() -> None:
    assert layout({}) == Topology(1, 0, "127.0.0.1", None, "local job")
    env = {"NNODES": "2", "NODE_RANK": "1", "MASTER_ADDR": "10.0.0.1"}
    two = layout(env)
    assert (two.nnodes, two.node_rank, two.master_port, two.leader) == (2, 1, "29500", False)
    assert two.job == "multi-node job at 10.0.0.1:29500"
    with pytest.raises(ConfigError, match="MASTER_ADDR: must be set"):
        layout({"NNODES": "2"})


def test_slurm_one_task_per_node_needs_no_exports() -> None:
    """(a) `srun --ntasks-per-node=1` on 2 nodes: torchrun per node; node 0 is the first host of
    the node list, the port comes from the job id."""
    node1 = layout(step(2, 2, "1(x2)", procid=1, nodeid=1))
    assert node1 == Topology(2, 1, "gpu07", "15123", "SLURM job 123 step 0")
    assert layout(step(2, 2, "1(x2)", procid=0)).leader and not node1.leader
    # one node: a free port, no scontrol
    one = topology(RunConfig(), step(1, 1, "1", procid=0), lambda n: pytest.fail("scontrol"))
    assert (one.nnodes, one.master_addr, one.master_port, one.task) == (1, "127.0.0.1", None, None)


def test_slurm_one_task_per_process_is_one_rank_of_one_job() -> None:
    """(b) `srun -N1 -n2` and `srun --ntasks-per-node=8` on 2 nodes: each task is a rank."""
    task1 = layout(step(2, 1, "2", procid=1, localid=1))
    assert task1.task == TaskRank(rank=1, world_size=2, local_rank=1, per_node=2)
    assert task1.master_addr == "127.0.0.1" and task1.master_port == "15123"
    assert not task1.leader and layout(step(2, 1, "2", procid=0)).leader
    big = layout(step(16, 2, "8(x2)", procid=11, localid=3, nodeid=1))
    assert big.task == TaskRank(rank=11, world_size=16, local_rank=3, per_node=8)
    assert (big.nnodes, big.node_rank, big.master_addr) == (2, 1, "gpu07")
    assert big.job == layout(step(16, 2, "8(x2)", procid=0)).job  # one job for every task


def test_the_batch_script_is_no_task() -> None:
    """`sbatch -n2` on one node: the batch shell sees SLURM_PROCID=0 and SLURM_NTASKS=2 but runs
    one launcher (torchrun starts the processes)."""
    batch = {**JOB, "SLURM_NNODES": "1", "SLURM_JOB_NUM_NODES": "1", "SLURM_NTASKS": "2",
             "SLURM_PROCID": "0", "SLURM_TASKS_PER_NODE": "2"}  # fmt: skip
    assert layout(batch) == Topology(1, 0, "127.0.0.1", None, "SLURM job 123")


@pytest.mark.parametrize(
    ("env", "named"),
    [
        ({**JOB, "SLURM_JOB_NUM_NODES": "2"}, "SLURM_JOB_NUM_NODES=2"),
        (step(3, 2, "2,1", procid=0), "SLURM_STEP_TASKS_PER_NODE=2,1"),
    ],
    ids=["batch-script-on-2-nodes", "uneven-tasks-per-node"],
)
def test_other_layouts_fail_naming_the_variables_and_both_layouts(
    env: dict[str, str], named: str
) -> None:
    with pytest.raises(ConfigError) as err:
        layout(env)
    text = err.value.render()
    assert named in text and "SLURM layout not supported" in text
    assert "(a) one task per node: srun --ntasks-per-node=1" in text
    assert "(b) one task per process: srun --ntasks-per-node=G" in text


def test_tasks_per_node() -> None:
    assert tasks_per_node("2(x3),1") == [2, 2, 2, 1]
    assert tasks_per_node("8") == [8]
    assert tasks_per_node("what") == []
