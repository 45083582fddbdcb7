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
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict
from datetime import timedelta
from pathlib import Path
from typing import Any

from loguru import logger

from ae.forensics.faults import ATTEMPT_ENV
from ae.job.folder_lock import unused_run_ts
from ae.job.restarts import NO_RESTART, RESTART_ENV, Attempt, Restart, Restarts

# Set by the launcher for a torchrun that restarts on its own: the job's --max_restarts, the
# first attempt's run TS, the run folder's logs and checkpoints, as JSON.
ELASTIC_ENV = "AE_ELASTIC"
DECISION_KEY = "ae/attempt"
ACK_KEY = "ae/attempt_read"
DECISION_WAIT_S = 300.0  # the judging agent reads every rank's logs first


class JobEnds(Exception):
    """The stop rules end the job: torchrun exits with `code` on every node."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code


class Attempts:
    """One node's agent's view of the job's attempts (each agent holds all of them: group rank
    0 may be another node after a change of membership)."""

    def __init__(self, max_restarts: int, base_ts: str, logs: Path, checkpoints: Path) -> None:
        self.restarts = Restarts(max_restarts, logs, checkpoints)
        self.logs = logs
        self.ts: str | None = None  # the attempt that runs now
        self.base_ts = base_ts
        self.number = -1

    def decide(self) -> dict[str, Any]:
        """Group rank 0's decision for the attempt about to start."""
        if self.ts is None:
            return {"ts": self.base_ts, "number": 0}
        nxt = self.restarts.after_failure(self.ts, 1)
        judged = asdict(self.restarts.failed[-1])
        if not isinstance(nxt, Restart):
            codes = self.restarts.failed[-1].rank_exit_codes
            code = nxt if nxt is not None else next((c for c in codes if c in NO_RESTART), 1)
            return {"exit": code, "message": self.restarts.said, "judged": judged}
        ts = unused_run_ts(self.logs, time.strftime("%Y%m%d_%H%M%S"))
        number = len(self.restarts.failed)
        return {"ts": ts, "number": number, "line": nxt.line, "args": nxt.args, "judged": judged}

    def take(self, decision: dict[str, Any], decided_here: bool) -> dict[str, Any]:
        """Record the published decision; raises JobEnds when it ends the job."""
        if "judged" in decision and not decided_here:
            judged = decision["judged"]
            self.restarts.failed.append(Attempt(**{k: tuple(v) if isinstance(v, list) else v
                                                   for k, v in judged.items()}))  # fmt: skip
        if "exit" in decision:
            if not decided_here and decision.get("message"):
                logger.error(decision["message"])
            raise JobEnds(decision["exit"], decision.get("message") or "")
        self.ts, self.number = decision["ts"], decision["number"]
        if "line" in decision:
            logger.warning(decision["line"])
        return decision


def agree(attempts: Attempts, store: Any, group_rank: int, nodes: int) -> dict[str, Any]:
    """The decision for this round: made by group rank 0, read from the round's store by all.
    Group rank 0 ends only once every node has read an ending (the store may live in its
    process)."""
    if group_rank == 0:
        payload = json.dumps(attempts.decide())
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
    attempts = Attempts(cfg["max_restarts"], cfg["ts"], Path(cfg["logs"]), Path(cfg["checkpoints"]))
    start_workers = LocalElasticAgent._start_workers
    base_args: list[tuple] = []

    def before_workers(self: Any, worker_group: Any) -> Any:
        decision = agree(
            attempts, worker_group.store, worker_group.group_rank, worker_group.group_world_size
        )
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
