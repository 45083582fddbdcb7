"""Restarts across several nodes, on torchrun's elastic agent (runs inside each node's torchrun).

torchrun with the c10d rendezvous (`--rdzv-backend=c10d`, one run id per job, `--max-restarts`)
restarts the workers of every node together when one fails: the failed node's agent joins the
next rendezvous round, and the healthy nodes' agents see it waiting and restart theirs. What it
does not give is what ae promises of every attempt, and its restart count cannot tell the
attempt: a node whose workers were still healthy restarts them as a membership change, which
torchrun does not count, so `TORCHELASTIC_RESTART_COUNT` differs between nodes of one attempt
(`_invoke_run` in torch/distributed/elastic/agent/server/api.py: `remaining_restarts` drops only
for a failed worker group).

So each agent, after every rendezvous and before it starts its workers (`before_workers`), takes
the attempt from the round's store: the agent of group rank 0 judges the attempt that just ended
(`ae.job.restarts`, from the shared run folder: every node's workers are stopped before the
round completes), picks the new attempt's run TS and publishes the decision; every agent sets
`AE_RUN_TS`, `AE_ATTEMPT` and the RESTART line for its workers, adds
`--resume_from_checkpoint=last`, and says the RESTART line on its node's console. When the stop
rules end the job, every agent ends with the same message and exit code (`JobEnds`).

With `--min_nodes=K` (torchrun's `--nnodes=K:N`) a round completes with K nodes or more once
the rendezvous stops waiting for the others (`RDZV_CONF`): a node whose agent is gone drops out
of the rendezvous when its heartbeats stop. Each agent names its host in the round's store, so
group rank 0 tells which nodes were lost or joined, and the RESTART line says so with the world
before and after (`NODES_CHANGED`); the ranks get `--num_nodes` of the round, and resume with
the fewer ranks as any resume on other ranks does (the rest of the epoch re-split, the LR
re-scaled).
"""

from __future__ import annotations

import json
import os
import re
import socket
import time
from collections import Counter
from dataclasses import asdict
from datetime import timedelta
from pathlib import Path
from typing import Any

from loguru import logger

from ae.config import RunConfig
from ae.forensics.faults import ATTEMPT_ENV
from ae.job.folder_lock import unused_run_ts
from ae.job.processes import JOIN_TIMEOUT_S  # fewer than --min_nodes nodes by then ends the job
from ae.job.rank_env import RESTART_ENV
from ae.job.restarts import NO_RESTART, Attempt, Restart, Restarts
from ae.job.topology import Topology
from ae.log_lines import NODES_CHANGED

# Set by the launcher for a torchrun that restarts on its own: the job's --max_restarts, the
# first attempt's run TS, the run folder's logs and checkpoints, as JSON.
ELASTIC_ENV = "AE_ELASTIC"
DECISION_KEY = "ae/attempt"
ACK_KEY = "ae/attempt_read"
HOST_KEY = "ae/host/{group_rank}"  # each agent's host and local ranks, in the round's store
DECISION_WAIT_S = 300.0  # the judging agent reads every rank's logs first
# torchrun's rendezvous timeouts (`--rdzv-conf`; docs/RUNS.md, "what each timeout is"). They
# matter only where --min_nodes is below the nodes: with all of them required, a round completes
# as soon as the last node joins.
LAST_CALL_S = 15  # once --min_nodes nodes are there, the round waits this long for the others
KEEP_ALIVE_S, KEEP_ALIVE_MISSED = 5, 3  # torchrun's defaults: a node silent 15 s is gone
RDZV_CONF = (
    f"join_timeout={JOIN_TIMEOUT_S},last_call_timeout={LAST_CALL_S},"
    f"keep_alive_interval={KEEP_ALIVE_S},keep_alive_max_attempt={KEEP_ALIVE_MISSED}"
)


def min_nodes_problems(run: RunConfig, topo: Topology) -> list[str]:
    """--min_nodes against the job's layout: 1 to NNODES, and only where torchrun's agent restarts
    the job (--max_restarts, several nodes, torchrun on each)."""
    k = run.min_nodes
    if k == 0:
        return []
    if not 1 <= k <= topo.nnodes:
        return [f"min_nodes: must be between 1 and the job's {topo.nnodes} node(s); got {k}"]
    if run.max_restarts == 0 or topo.nnodes == 1 or topo.task is not None:
        if topo.nnodes == 1:
            why = "this job runs on one node"
        elif topo.task is not None:
            why = "SLURM's one-task-per-process layout runs no torchrun (use one task per node)"
        else:
            why = "without --max_restarts the job ends at its first failure"
        return [
            "min_nodes: going on with fewer nodes needs --max_restarts and several nodes under "
            f"torchrun; {why}"
        ]
    return []


def agent_args(run: RunConfig, topo: Topology, port: str, local_addr: str) -> list[str]:
    """torchrun's arguments for an agent that restarts every node together: c10d rendezvous,
    one run id per job, `--nnodes=K:N`. One more restart than --max_restarts, so that every agent
    reaches the round in which the stop rules end the job (a node restarted by a change of
    membership counts none). Node 0 hosts the rendezvous store (`is_host`: torchrun's own guess
    compares MASTER_ADDR with the hostname's address, 127.0.1.1 on Debian's default /etc/hosts);
    `--local-addr` is the address that reaches the master, which the node that becomes group
    rank 0 names to every rank as their MASTER_ADDR (not the hostname's, likewise)."""
    nodes = f"{run.min_nodes or topo.nnodes}:{topo.nnodes}"
    return [
        f"--nnodes={nodes}", "--rdzv-backend=c10d", f"--rdzv-endpoint={topo.master_addr}:{port}",
        f"--rdzv-id={rdzv_id(topo)}", f"--max-restarts={run.max_restarts + 1}",
        f"--rdzv-conf=is_host={int(topo.node_rank == 0)},{RDZV_CONF}", f"--local-addr={local_addr}",
    ]  # fmt: skip


def rdzv_id(topo: Topology) -> str:
    """One rendezvous run id per job, the same on every node (`topo.job` names the job)."""
    return re.sub(r"[^A-Za-z0-9_-]+", "_", topo.job).strip("_")


def nodes_changed(before: list[str], after: list[str], worlds: tuple[int, int], total: int) -> str:
    """The NODES_CHANGED line between two attempts' hosts (group rank order), "" when the same."""
    lost = list((Counter(before) - Counter(after)).elements())
    joined = list((Counter(after) - Counter(before)).elements())
    parts = [f"{', '.join(names)} {what}" for names, what in ((lost, "lost"), (joined, "joined"))
             if names]  # fmt: skip
    if not parts:
        return ""
    return NODES_CHANGED.format(change=", ".join(parts), nodes=len(after), total=total,
                                before=worlds[0], after=worlds[1])  # fmt: skip


class JobEnds(Exception):
    """The stop rules end the job: torchrun exits with `code` on every node."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code


def failed_attempts(data: list[dict[str, Any]]) -> list[Attempt]:
    """The failed attempts as JSON carries them (lists for tuples)."""
    return [Attempt(**{k: tuple(v) if isinstance(v, list) else v for k, v in a.items()})
            for a in data]  # fmt: skip


class Attempts:
    """One node's agent's view of the job's attempts. Each agent holds all of them and names
    them in every round (`known`): group rank 0 may be another node after a change of
    membership, and a node that joins later knows none."""

    def __init__(
        self, max_restarts: int, base_ts: str, logs: Path, checkpoints: Path, nnodes: int = 1
    ) -> None:
        self.restarts = Restarts(max_restarts, logs, checkpoints)
        self.logs = logs
        self.ts: str | None = None  # the attempt that runs now
        self.base_ts = base_ts
        self.number = -1
        self.nnodes = nnodes  # NNODES, all the job may have
        self.hosts: list[str] = []  # the nodes of the attempt that runs now, by group rank
        self.world = 0  # its ranks

    def known(self) -> dict[str, Any]:
        """What this agent knows of the job's attempts, as JSON data."""
        return {"ts": self.ts, "number": self.number, "hosts": self.hosts, "world": self.world,
                "failed": [asdict(a) for a in self.restarts.failed]}  # fmt: skip

    def adopt(self, known: dict[str, Any]) -> None:
        """Take what another agent knows where it knows more (a later attempt)."""
        if known["number"] <= self.number:
            return
        self.ts, self.number = known["ts"], known["number"]
        self.hosts, self.world = known["hosts"], known["world"]
        self.restarts.failed = failed_attempts(known["failed"])

    def decide(self, hosts: list[str], world: int, failed: bool = True) -> dict[str, Any]:
        """Group rank 0's decision for the attempt about to start on `hosts` (the round's nodes,
        by group rank) with `world` ranks; `failed`: whether a node's workers failed (else the
        agents restarted healthy workers to take in a node that joined)."""
        members = {"hosts": hosts, "world": world, "args": [f"--num_nodes={len(hosts)}"]}
        if self.ts is None:
            return {"ts": self.base_ts, "number": 0, **members}
        change = nodes_changed(self.hosts, hosts, (self.world, world), self.nnodes)
        nxt = (self.restarts.after_failure(self.ts, 1, change) if failed or not change
               else self.restarts.after_change(self.ts, change))  # fmt: skip
        history = {"failed": [asdict(a) for a in self.restarts.failed]}
        if not isinstance(nxt, Restart):
            codes = self.restarts.failed[-1].rank_exit_codes
            code = nxt if nxt is not None else next((c for c in codes if c in NO_RESTART), 1)
            return {"exit": code, "message": self.restarts.said, **history}
        ts = unused_run_ts(self.logs, time.strftime("%Y%m%d_%H%M%S"))
        return {"ts": ts, "number": self.number + 1, "line": nxt.line, **history,
                **members, "args": [*nxt.args, *members["args"]]}  # fmt: skip

    def take(self, decision: dict[str, Any], decided_here: bool) -> dict[str, Any]:
        """Record the published decision; raises JobEnds when it ends the job."""
        if "failed" in decision:
            self.restarts.failed = failed_attempts(decision["failed"])
        if "exit" in decision:
            if not decided_here and decision.get("message"):
                # exit 0: the training had finished, a rank died in teardown (a note, no error)
                say = logger.warning if decision["exit"] == 0 else logger.error
                say(decision["message"])
            raise JobEnds(decision["exit"], decision.get("message") or "")
        self.ts, self.number = decision["ts"], decision["number"]
        self.hosts, self.world = decision["hosts"], decision["world"]
        if "line" in decision:
            logger.warning(decision["line"])
        return decision


def agree(
    attempts: Attempts, store: Any, group_rank: int, nodes: int, world: int = 0,
    host: str | None = None, failed: bool = True,
) -> dict[str, Any]:  # fmt: skip
    """The decision for this round: made by group rank 0, read from the round's store by all.
    Every agent first names there its host (`host`, default this machine's name), whether its
    workers failed, and what it knows of the attempts; group rank 0 ends only once every node
    has read an ending (the store may live in its process)."""
    me = {"host": host or socket.gethostname(), "failed": failed, "known": attempts.known()}
    store.set(HOST_KEY.format(group_rank=group_rank), json.dumps(me))
    if group_rank == 0:
        keys = [HOST_KEY.format(group_rank=r) for r in range(nodes)]
        store.wait(keys, timedelta(seconds=DECISION_WAIT_S))
        members = [json.loads(store.get(k)) for k in keys]
        for m in members:
            attempts.adopt(m["known"])
        hosts = [m["host"] for m in members]
        decision = attempts.decide(hosts, world or nodes, any(m["failed"] for m in members))
        payload = json.dumps(decision)
        store.set(DECISION_KEY, payload)
        decision = json.loads(payload)  # as every other node reads it
        if "exit" in decision:
            deadline = time.monotonic() + DECISION_WAIT_S
            while int(store.add(ACK_KEY, 0)) < nodes - 1 and time.monotonic() < deadline:
                time.sleep(0.1)
    else:
        store.wait([DECISION_KEY], timedelta(seconds=DECISION_WAIT_S))
        decision = json.loads(store.get(DECISION_KEY))
        store.add(ACK_KEY, 1)
    return attempts.take(decision, decided_here=group_rank == 0)


def install(setting: str) -> None:
    """Hook `before_workers` into torchrun's LocalElasticAgent (in this torchrun process only)."""
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

    cfg = json.loads(setting)
    attempts = Attempts(cfg["max_restarts"], cfg["ts"], Path(cfg["logs"]), Path(cfg["checkpoints"]),
                        cfg["nnodes"])  # fmt: skip
    start_workers = LocalElasticAgent._start_workers
    base_args: list[tuple] = []
    restarts_left = [cfg["max_restarts"] + 1]  # torchrun's `--max-restarts` (`agent_args`)

    def before_workers(self: Any, worker_group: Any) -> Any:
        # The round's ranks are assigned before the workers start: their world size is known.
        world = worker_group.workers[0].world_size if worker_group.workers else 0
        # torchrun spends a restart only on workers that failed (not on a membership change).
        remaining = getattr(self, "_remaining_restarts", 0)
        failed = remaining < restarts_left[0]
        restarts_left[0] = remaining
        decision = agree(attempts, worker_group.store, worker_group.group_rank,
                         worker_group.group_world_size, world, failed=failed)  # fmt: skip
        spec = worker_group.spec
        if not base_args:
            base_args.append(tuple(spec.args))
        spec.args = (*base_args[0], *decision.get("args", []))
        os.environ["AE_RUN_TS"] = decision["ts"]
        os.environ[ATTEMPT_ENV] = str(decision["number"])
        if "line" in decision:
            os.environ[RESTART_ENV] = decision["line"]
        return start_workers(self, worker_group)

    LocalElasticAgent._start_workers = before_workers
