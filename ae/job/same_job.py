"""Several nodes: every node's launcher must run the same job, and a node that will not join
it says so to node 0's launcher, whose torchrun would otherwise wait for it up to 600 s.

Node 0's launcher writes the job's settings (NNODES, processes per node, the flags:
`job_settings`) into the run folder's lock (`ae.job.folder_lock`); each other node's compares
its own once it has followed the lock, and a node started otherwise refuses to join, naming
each difference (`NodesDiffer`): another `--batch_size` gives other steps per epoch and hangs
the job at the first epoch's end, another NNODES fails in Lightning's `num_nodes` check.

A node's launcher that stops before it joins (started otherwise, or a user error of its own:
its shards missing there, a bad flag) leaves a note in the run folder (`tell_leader`,
`RunDir.refused`); node 0's launcher reads it while it waits for the nodes to join
(`ae.job.peer_nodes.PeerNodes.refused`), stops its torchrun and exits 2 too. A node whose own
ranks failed leaves a note of another name (`RunDir.failed`, `ae.job.ending`) for every other
node's launcher, whose ranks would wait for its ranks up to --pg_timeout. A note is written whole
or not at all (`ae.atomic_files`): it is read from other hosts while it may be written.
"""

from __future__ import annotations

import json
import socket
import time
from typing import Any

from loguru import logger

from ae import atomic_files
from ae.config import Config
from ae.errors import UserError
from ae.job.folder_lock import FOLLOW_POLL_S, LockInfo, lock_held, read_lock
from ae.job.topology import Topology, topology
from ae.run_paths import RunDir

# Flags a node may set otherwise than the others: a launch's actions, the shard specs (a node
# may mount the data elsewhere; the ranks check that they read the same samples), the node
# count (NNODES is compared), the console's detail.
NODE_LOCAL_FLAGS = frozenset(
    {"config", "print_config", "overwrite", "train_shards", "val_shards", "num_nodes", "debug"}
)
TELL_WAIT_S = 10.0  # a node that stops on a user error waits this long for node 0's lock
SAME_START = (
    "Start the launcher on every node with the same NNODES, MASTER_ADDR, MASTER_PORT and flags, "
    "only NODE_RANK differing"
)


def job_settings(cfg: Config, topo: Topology, nproc: int) -> dict[str, Any] | None:
    """What every node of a multi-node job must run alike: NNODES, the processes per node, every
    flag but NODE_LOCAL_FLAGS; None for one node."""
    if topo.nnodes == 1:
        return None
    flags = {f"--{k}": v for k, v in cfg.to_dict().items() if k not in NODE_LOCAL_FLAGS}
    return {"NNODES": topo.nnodes, "processes per node": nproc, **flags}


def differences(first: dict[str, Any] | None, here: dict[str, Any] | None, node: int) -> list[str]:
    """What node `node` runs otherwise than the first node (`NNODES=3 on node 1, 2 on node 0`),
    from their settings; none when either is unknown (a lock written before settings)."""
    if first is None or here is None:
        return []
    here = json.loads(json.dumps(here))  # as the first node's went through the lock file
    return [
        f"{key}={_show(here.get(key))} on node {node}, {_show(first.get(key))} on node 0"
        for key in sorted(set(first) | set(here), key=lambda k: (k.startswith("-"), k))
        if first.get(key) != here.get(key)
    ]


def _show(value: Any) -> str:
    if isinstance(value, list):
        return ",".join(map(str, value))
    return "(unset)" if value is None else str(value)


class NodesDiffer(UserError):
    def __init__(self, holder: LockInfo, node: int, diffs: list[str]) -> None:
        super().__init__(
            f"Node {node} was not started like node 0 ({holder.describe()}): "
            f"{'; '.join(diffs)}.\n  {SAME_START}. Nothing started here; node 0 stops too."
        )


def check_same_job(
    run_dir: RunDir, holder: LockInfo, settings: dict[str, Any] | None, node: int
) -> None:
    """Node `node`'s `settings` against node 0's (`holder`, the lock it followed): NodesDiffer,
    told to node 0 too, when they differ."""
    if diffs := differences(holder.settings, settings, node):
        why = f"started otherwise than node 0: {'; '.join(diffs)}.\n  {SAME_START}"
        tell_leader(run_dir, holder.run_ts, node, why)
        raise NodesDiffer(holder, node, diffs)


def tell_leader(
    run_dir: RunDir, run_ts: str | None, node: int, message: str, job: str = "",
    failed: bool = False,
) -> bool:  # fmt: skip
    """Node `node`'s launcher will not join run `run_ts` (`message`: why): a note for node 0's
    launcher. `run_ts` None: the run of `job`, whose lock this waits for up to TELL_WAIT_S (the
    nodes start together; node 0's launcher takes the lock within a second or two). `failed`:
    its ranks failed instead (`RunDir.failed`, for every other node's launcher). Whether a note
    was left. Written whole or not at all: node 0's launcher reads it from another host."""
    deadline = time.monotonic() + TELL_WAIT_S
    while run_ts is None:
        holder = read_lock(run_dir.lock)
        if holder is not None and holder.job == job and lock_held(run_dir.lock):
            run_ts = holder.run_ts
        elif time.monotonic() > deadline:
            return False
        else:
            time.sleep(FOLLOW_POLL_S)
    note = {"run_ts": run_ts, "node": node, "host": socket.gethostname(), "message": message}
    try:
        path = run_dir.failed(node) if failed else run_dir.refused(node)
        atomic_files.write(path, json.dumps(note).encode(), durable=False)
    except OSError:
        return False
    return True


def tell_node_0(cfg: Config | None, topo: Topology | None, ts: str | None, e: UserError) -> None:
    """Another node's launcher that stops on a user error (its own data missing, a bad flag)
    tells node 0's (`tell_leader`); one started otherwise has told it already. `cfg`: the flags
    that parsed, at least; `topo`, `ts`: None where the launcher stopped before it knew them."""
    if isinstance(e, NodesDiffer) or cfg is None:
        return
    if topo is None:
        try:
            topo = topology(cfg.run)
        except UserError:
            return
    if topo.leader or topo.nnodes == 1 or topo.task is not None:
        return
    if tell_leader(cfg.run.dir, ts, topo.node_rank, e.render(), topo.job):
        logger.info("Node 0's launcher is told, and stops too")
