"""How one attempt of the job ended on this node, from its child's exit code and the stops that
came (`ae.job.supervise.Stops`): a stop, a failure to report or restart, done.

On several nodes each node's launcher speaks for its own console, where its user reads it (by
hand, each node has its own terminal): a failure's diagnosis, a stop's checkpoint, `Done`. Only
SLURM's one task per process, whose tasks share srun's output, leaves that to the first task.

A node whose own ranks failed tells the other nodes' launchers (`ae.job.same_job.tell_leader`'s
`failed` note): their ranks, waiting for its ranks to set up the process group (or in a
collective), would wait up to --pg_timeout; they stop theirs within seconds instead
(`ae.job.peer_nodes.PeerNodes.failed`).
"""

from __future__ import annotations

import signal
import socket

from loguru import logger

from ae.config import Config
from ae.errors import UserError
from ae.job.outcome import (
    RESUME,
    failed_here,
    finished,
    finished_in_teardown,
    preempted,
    report_stop,
    stop_exit_code,
)
from ae.job.peer_nodes import never_joined
from ae.job.restarts import newest_checkpoint
from ae.job.same_job import tell_leader
from ae.job.supervise import Stops
from ae.job.topology import Topology


def ending(cfg: Config, topo: Topology, ts: str, rc: int, stops: Stops) -> int | None:
    """How an attempt ended: None when it ended well; -(the job's exit code) when it ends the
    job and said so (a stop signal; a job whose nodes never joined); else the child's non-zero
    exit code (a failure that the caller reports, or restarts)."""
    logs = cfg.run.dir.logs
    if stops.refused is not None:  # no rank started: the other node's user error, said
        return -UserError.exit_code
    if stops.elsewhere is not None:  # every rank saved: a stop, said by each node's launcher
        logger.warning(f"{stops.elsewhere}; {RESUME}")
        return -stop_exit_code(signal.SIGTERM)
    if stops.lost is not None:  # a failure, whatever the SIGKILLed torchrun returned
        rc = rc if rc > 0 else 1
    rc = 128 - rc if rc < 0 else rc  # a child killed by signal N: 128 + N, as a shell says
    # Stopped by a signal (torchrun then fails; a SLURM task's one rank exits 0 after its save),
    # unless the run ended well just before.
    sig = stops.first
    if sig is not None and not stops.killed and preempted(logs, ts) is None:
        if rc == 0:
            sig = None
        elif (done := finished(logs, ts)) is not None:
            # The ranks agree on a stop at their next vote (about a second apart): a signal
            # that came in the run's last second finds it finished. torchrun, signalled too,
            # exits non-zero; there is nothing to save and nothing to requeue.
            logger.info(f"The stop signal came as the run ended: training finished at step "
                        f"{done['step']}")  # fmt: skip
            rc, sig = 0, None
    if rc != 0 and sig is None and (done := finished_in_teardown(logs, ts)) is not None:
        # A rank killed after training finished (in teardown): the checkpoints are complete and
        # a restart would redo nothing. Exit 0, as schedulers and `afterok` chains read a
        # usable result; the note says what happened. Before the per-node split: every node's
        # launcher reads the same logs and agrees.
        logger.warning(done)
        rc = 0
    if rc == 0 and sig is None and (saved := preempted(logs, ts)) is not None:
        # Every rank saved and stopped on a signal this launcher never got (another node's
        # launcher killed, where `PeerNodes.stopped_elsewhere` cannot tell the nodes apart: one
        # host name; a rank signalled directly), and torchrun ended well: a stop, 143, as a
        # scheduler must read it, never "Done" with exit 0.
        where = "on another node" if topo.nnodes > 1 else "by a signal to a rank"
        logger.warning(f"Stopped {where}: every rank saved step {saved['step']}: "
                       f"{saved['path']}; {RESUME}")  # fmt: skip
        return -stop_exit_code(signal.SIGTERM)
    if rc != 0 and sig is None and topo.nnodes > 1 and (said := never_joined(logs, ts, topo)):
        logger.error(said)  # not the failure report: no rank started, none wrote a log
        return -rc
    if not topo.leader and topo.task is not None and stops.lost is None:
        # One rank per SLURM task: the tasks share srun's output, the first task's speaks.
        return -stop_exit_code(sig) if sig is not None else (-rc or None)
    if rc != 0 and sig is None and stops.lost is None and topo.nnodes > 1:
        tell_the_other_nodes(cfg, topo, ts)
    if sig is not None:
        newest = newest_checkpoint(cfg.run.dir.checkpoints)
        return -report_stop(logs, ts, sig, stops.killed, newest)
    if rc == 0:
        logger.info(f"Done. Logs: {logs}/ (run {ts})")
        return None
    return rc


def tell_the_other_nodes(cfg: Config, topo: Topology, ts: str) -> None:
    """This node's ranks failed: a note for the other nodes' launchers, naming the ranks of this
    host that the diagnosis blames and their error; none when it blames no rank here (they only
    followed another node's failure, which the others see themselves)."""
    if topo.task is not None or cfg.run.max_restarts > 0:
        return  # torchrun's agents restart, or end, every node together (`ae.job.elastic`)
    if (blamed := failed_here(cfg.run.dir.logs, ts, socket.gethostname())) is not None:
        tell_leader(cfg.run.dir, ts, topo.node_rank, blamed, failed=True)
