"""The launcher behind ./train_ae.sh: validate flags, claim the run folder, prepare data, then
run torchrun -- and say how it ended.

Everything a user can get wrong is checked here, in about a second and before any worker process
exists: flags, the config file, shard specs, the job's layout (`ae.job.topology`: environment
variables or SLURM), a run folder in use or holding an earlier run's checkpoints
(`ae.job.folder_lock`). Then one torchrun per node starts the ranks: `--nproc_per_node` from
`--devices` (auto: all GPUs, else 2 CPU processes); the launcher runs a node's one rank itself
where there is nothing for torchrun to coordinate (one process on one node; a SLURM task's rank:
`rank_is_child`). Stop signals are passed on (`ae.job.supervise`);
the end is reported by `ae.job.outcome`: the checkpoint after a stop, the diagnosis after a
failure. With `--max_restarts`, a failed job starts again from its newest checkpoint, one torchrun
per attempt, while the stop rules of `ae.job.restarts` allow.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from contextlib import nullcontext
from functools import partial
from pathlib import Path

from loguru import logger

from ae.config import (
    BUILTIN_MODELS,
    PREFETCH_FACTOR,
    Config,
    ConfigError,
    parse_config,
)
from ae.config.model_path import locate_class
from ae.data.shards.demo import with_demo_defaults
from ae.data.shards.spec import resolve_shards
from ae.diagnose.log_files import list_runs
from ae.errors import UserError
from ae.forensics.faults import ATTEMPT_ENV, active_faults
from ae.job.elastic import ELASTIC_ENV, agent_args, min_nodes_problems
from ae.job.ending import ending
from ae.job.folder_lock import RunLock, acquire, earlier_checkpoints, follow, unused_run_ts
from ae.job.network import prepare_node, route_to
from ae.job.outcome import RESUME, report_failure, say_goodput, stop_exit_code
from ae.job.peer_nodes import PeerNodes
from ae.job.preflight import check, launcher_needs, weights_problems
from ae.job.processes import (
    TORCHRUN_MODULE,
    child_rank_env,
    free_port,
    note_rank_end,
    processes_per_node,
    rank_command,
    rank_is_child,
    shared_cores_note,
    static_nodes,
)
from ae.job.rank_env import LAUNCHER_ENV, RESTART_ENV, RESUME_NOTE_ENV
from ae.job.rank_lines import rank_lines
from ae.job.restarts import (
    Restart,
    Restarts,
    newest_checkpoint,
    requeue_job,
    resume_note,
)
from ae.job.same_job import check_same_job, job_settings, tell_node_0
from ae.job.supervise import Stops, start_child, stop_signals, wait
from ae.job.topology import Topology, topology
from ae.log_lines import LAUNCHER_LOG_FILE, TRAIN_LOG_FILE

RANK_MODULE = "ae.cli.rank_process"  # what runs in every rank (train_ae.py runs the same)


def claim_run_folder(cfg: Config, topo: Topology, nproc: int) -> tuple[RunLock | None, str]:
    """The job's run folder and run TS: the first node's launcher takes the lock (and refuses a
    fresh run over earlier checkpoints); the others wait until the lock names their job, and
    refuse to join one started otherwise than theirs (`job_settings`)."""
    run_dir, ckpt = cfg.run.dir, cfg.checkpoints
    settings = job_settings(cfg, topo, nproc)
    if not topo.leader:
        if not cfg.run.overwrite:  # the leader's refusal, at once (it never takes the lock then)
            earlier_checkpoints(run_dir, ckpt.resume_from_checkpoint, overwrite=False)
        holder = follow(run_dir, topo.job)
        check_same_job(run_dir, holder, settings, topo.node_rank)
        return None, holder.run_ts
    ts = os.environ.get("AE_RUN_TS") or unused_run_ts(run_dir.logs, time.strftime("%Y%m%d_%H%M%S"))
    lock = acquire(run_dir, topo.job, ts, settings=settings)
    try:
        if lock.taken_over is not None:
            logger.info(f"Took over {run_dir.lock}, left by {lock.taken_over.describe()}: gone")
        removed = earlier_checkpoints(
            run_dir, ckpt.resume_from_checkpoint, overwrite=cfg.run.overwrite
        )
        if removed:
            logger.warning(
                f"--overwrite=true: deleted {len(removed)} checkpoint(s) of an earlier run "
                f"from {run_dir.checkpoints}"
            )
    except BaseException:
        lock.release()
        raise
    return lock, ts


def child_command(
    cfg: Config, topo: Topology, nproc: int, argv: list[str], extra: list[str], launcher_log: Path
) -> tuple[list[str], dict[str, str]]:
    """torchrun over this node's ranks; or the one rank the launcher starts itself."""
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    port = topo.master_port or str(free_port())
    if rank_is_child(topo, nproc):
        env.update(child_rank_env(topo, port, launcher_log, cfg.obs.debug))
        return [sys.executable, "-u", "-m", RANK_MODULE, *argv, *extra], env
    if elastic(cfg, topo):
        # torchrun's elastic agent restarts every node's workers together (`ae.job.elastic`).
        nodes = agent_args(cfg.run, topo, port, route_to(topo.master_addr, int(port)).source_ip)
        # Each round's ranks get a store of their own (group rank 0's first rank hosts it): the
        # agents' shared one outlives the round, and a rank of the next attempt would read the
        # dead attempt's gloo addresses from it.
        env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
        ts = LAUNCHER_LOG_FILE.regex.fullmatch(launcher_log.name)["ts"]
        env[ELASTIC_ENV] = json.dumps({
            "max_restarts": cfg.run.max_restarts, "ts": ts, "nnodes": topo.nnodes,
            "logs": str(cfg.run.dir.logs), "checkpoints": str(cfg.run.dir.checkpoints),
        })  # fmt: skip
    else:
        nodes = static_nodes(topo, port)
    cmd = [
        sys.executable, "-m", TORCHRUN_MODULE, str(launcher_log), str(os.getpid()), *nodes,
        f"--nproc_per_node={nproc}", *rank_command(cfg.obs.debug, RANK_MODULE), *argv, *extra,
    ]  # fmt: skip
    return cmd, env


def elastic(cfg: Config, topo: Topology) -> bool:
    """Several nodes under torchrun with --max_restarts: torchrun's agent restarts the job."""
    return cfg.run.max_restarts > 0 and topo.nnodes > 1 and topo.task is None


def launch(argv: list[str]) -> int:
    """The whole job on this node, from its flags to its exit code (logging to the console)."""
    lock, ts, topo, cfg = None, None, None, None
    try:
        cfg = parse_config(argv, user=True)
        topo = topology(cfg.run)
        nproc, problems = processes_per_node(cfg.run, topo, cfg.data.image_decode)
        problems += min_nodes_problems(cfg.run, topo)
        if problems:
            raise ConfigError(problems)
        if cfg.run.print_config:
            # Data, not a log line: plain YAML on stdout, so `--print_config > run.yaml` works.
            sys.stdout.write(cfg.to_yaml())
            return 0
        if cfg.model.model not in BUILTIN_MODELS and (problem := locate_class(cfg.model.model)):
            raise ConfigError([problem])  # the import itself is tried in the ranks
        active_faults()  # a malformed AE_FAULT: one message here, not a traceback per rank
        if problems := weights_problems(cfg):
            raise ConfigError(problems)
        # A limit the run cannot work within stops it here, before any rank exists. A tight one
        # is the ranks' to say, reckoned with the measured batch and model: the launcher's base
        # sizes gave a second, different estimate of the same resource.
        check(launcher_needs(cfg, nproc, nproc * topo.nnodes, PREFETCH_FACTOR))
        if (note := shared_cores_note(cfg.run, nproc)) is not None:
            logger.info(note)
        if topo.nnodes > 1:  # the interface that reaches the master, and whether it does
            port = int(topo.master_port or 29500)
            line = prepare_node(
                os.environ, topo.master_addr, port, topo.node_rank, hosts_store=topo.leader
            )
            logger.info(line)
        lock, ts = claim_run_folder(cfg, topo, nproc)
        # The demo data stands in for an unset spec: built (once) here, named to the ranks.
        train_spec, val_spec = with_demo_defaults(cfg.data.train_shards, cfg.data.val_shards)
        try:
            train_urls, _ = resolve_shards(train_spec, val_spec)
        except UserError as e:
            raise ConfigError(e.render().splitlines()) from None
    except UserError as e:
        if lock is not None:
            lock.release()
        logger.error(e.render())
        tell_node_0(cfg or getattr(e, "partial", None), topo, ts, e)
        return e.exit_code
    except KeyboardInterrupt:  # Ctrl-C before any rank exists: nothing to save
        if lock is not None:
            lock.release()
        logger.warning("Interrupted before training started")
        return stop_exit_code(signal.SIGINT)
    try:
        return run(cfg, topo, nproc, ts, argv, len(train_urls), [train_spec, val_spec], lock)
    finally:
        if lock is not None:
            lock.release()


def run(
    cfg: Config, topo: Topology, nproc: int, ts: str, argv: list[str], n_train: int,
    specs: list[str | None], lock: RunLock | None = None,
) -> int:  # fmt: skip
    """The job's attempts: the first, then, after a failure, a restart from the newest
    checkpoint while `--max_restarts` and the stop rules allow (`ae.job.restarts`). `lock`: the
    folder's lock this launcher holds, shared with each attempt's child. A job that restarted
    ends with what its failures cost (the first node's launcher: the GOODPUT line)."""
    code, last = attempts(cfg, topo, nproc, ts, argv, n_train, specs, lock)
    if last != ts and topo.leader:
        say_goodput(cfg.run.dir.logs, last, failed=0 < code < 128)
    return code


def attempts(
    cfg: Config, topo: Topology, nproc: int, ts: str, argv: list[str], n_train: int,
    specs: list[str | None], lock: RunLock | None = None,
) -> tuple[int, str]:  # fmt: skip
    """`run`'s loop: the job's exit code, and the run TS of its last attempt."""
    logs = cfg.run.dir.logs
    logs.mkdir(parents=True, exist_ok=True)
    restarts = Restarts(cfg.run.max_restarts, logs, cfg.run.dir.checkpoints)
    if cfg.run.max_restarts and topo.task is not None:
        logger.warning(
            "--max_restarts: restarts need torchrun (one task per node under SLURM, "
            "docs/RUNS.md); this job ends at its first failure"
        )
        restarts.max = 0
    if elastic(cfg, topo):  # torchrun's agent restarts; its last attempt is the newest run
        restarts.max = 0
    restart: Restart | None = None
    while True:
        rc, stops, said = attempt(
            cfg, topo, nproc, ts, argv, specs, restart, len(restarts.failed), n_train, lock
        )
        if elastic(cfg, topo):
            ts = max((t for t in list_runs(logs) if t >= ts), default=ts)
        code = ending(cfg, topo, ts, rc, stops)
        if code is None:
            return 0, ts
        if code < 0:  # the job's exit code, said already (a stop signal, another node)
            if stops.requeue and topo.leader:
                # `scontrol requeue` ends this job step with SIGTERM at once; the ranks have
                # saved and stopped, so this launcher ignores it, to release the run folder and
                # exit 138 rather than die with the lock file left behind.
                signal.signal(signal.SIGTERM, signal.SIG_IGN)
                requeue_job(os.environ)
            return -code, ts
        newest = newest_checkpoint(cfg.run.dir.checkpoints)
        if restarts.max == 0:
            return report_failure(logs, ts, code, said, newest=newest, resumable=True), ts
        try:
            nxt = restarts.after_failure(ts, code)
            if nxt == 0:  # its training had finished: said, and no failure to report
                return 0, ts
            if not isinstance(nxt, Restart):
                code = report_failure(logs, ts, code, said, newest=newest, resumable=True)
                return (code if nxt is None else nxt), ts
            logger.warning(nxt.line)
            restart = nxt
            ts = unused_run_ts(logs, time.strftime("%Y%m%d_%H%M%S"))
        except KeyboardInterrupt:  # Ctrl-C between two attempts: no rank runs, nothing to save
            logger.warning(f"Interrupted between two attempts; {RESUME}")
            return stop_exit_code(signal.SIGINT), ts


def attempt(
    cfg: Config, topo: Topology, nproc: int, ts: str, argv: list[str], specs: list[str],
    restart: Restart | None, number: int, n_train: int, lock: RunLock | None = None,
) -> tuple[int, Stops, set[str] | None]:  # fmt: skip
    """One attempt of the job, as run TS `ts`: this node's child (torchrun, or a SLURM task's
    rank), to its end; its exit code, the stops that came, and the ERROR messages the console
    said meanwhile (`ae.job.rank_lines`: the report of a failure says none again). The child
    holds `lock` too (an inherited descriptor of the same flock): a killed launcher leaves the
    folder locked until its child, which follows it (`ae.job.torchrun`), is gone."""
    logs = cfg.run.dir.logs
    launcher_log = logs / LAUNCHER_LOG_FILE.format(ts=ts)
    extra = [f"--devices={nproc}", f"--num_nodes={topo.nnodes}"]
    extra += [f"--train_shards={specs[0]}"]
    if specs[1] is not None:  # None: held out of the train shards, by the ranks
        extra.append(f"--val_shards={specs[1]}")
    cmd, env = child_command(cfg, topo, nproc, argv, extra + (restart.args if restart else []),
                             launcher_log)  # fmt: skip
    env["AE_RUN_TS"] = ts
    env[LAUNCHER_ENV] = "1"
    env[ATTEMPT_ENV] = str(number)
    if restart is not None:
        env[RESTART_ENV] = restart.line
    if topo.leader and restart is None:
        where = f"node {topo.node_rank}/{topo.nnodes}, " if topo.nnodes > 1 else ""
        how = "one process per SLURM task" if topo.task else f"{nproc} process(es) per node"
        torchrun = "" if rank_is_child(topo, nproc) else (
            f"\n  launcher  : {launcher_log} (torchrun's own output)")  # fmt: skip
        logger.info(
            f"Training on {where}{how}, {n_train} train shards ({topo.job})"
            f"\n  train log : {logs}/train_{ts}.log"
            f"\n  rank logs : {logs}/debug_rank*_{ts}.log"
            f"\n  native    : {logs}/native_rank*_{ts}.log (NCCL, gloo, C extensions)"
            f"{torchrun}"
            f"\n  follow    : tail -f {logs}/debug_rank*_{ts}.log"
        )
        resume = cfg.checkpoints.resume_from_checkpoint
        if note := resume_note(cfg.run.dir.checkpoints, resume, logs, ts):
            logger.info(note)
            env[RESUME_NOTE_ENV] = note
    elif restart is None and topo.task is None:  # another node: which job, its logs
        logger.info(
            f"Training on node {topo.node_rank}/{topo.nnodes}, {nproc} process(es) per node "
            f"({topo.job}, run {ts})\n  rank logs : {logs}/debug_rank*_{ts}.log"
        )
    with stop_signals() as stops:  # before the child starts: `ae.job.supervise`
        proc = start_child(cmd, env, stops, lock.descriptors() if lock is not None else ())
        if proc is None:  # a stop came before it: no rank to stop, nothing to save
            return stop_exit_code(stops.first), stops, None  # type: ignore[arg-type]
        rc, stops, said = _watch(cfg, topo, logs, ts, restart, proc, stops)
    if rc != 0 and rank_is_child(topo, nproc):
        rc = note_rank_end(launcher_log, topo, proc.pid, rc)
    return rc, stops, said


def _watch(
    cfg: Config, topo: Topology, logs: Path, ts: str, restart: Restart | None,
    proc: subprocess.Popen, stops: Stops,
) -> tuple[int, Stops, set[str] | None]:  # fmt: skip
    """`attempt`'s wait for its child, with the other nodes watched and the other ranks' lines
    said."""
    # Another node that dies closes no connection: its heartbeats tell (`ae.job.peer_nodes`).
    # The leader's console also says the other ranks' errors and stalls (`ae.job.rank_lines`).
    peers_said = rank_lines(logs / TRAIN_LOG_FILE.format(ts=ts)) if topo.leader else nullcontext()
    with peers_said as relay:
        # Under torchrun's elastic agent a rank that dies mid-attempt is a restart, not a lost
        # node (the agents watch each other); a stop that reached another node (its launcher
        # killed: its torchrun follows it) is still a stop, which the other nodes' torchruns
        # would otherwise wait out in their exit barrier (300 s).
        peers = PeerNodes(logs, ts, follow_restarts=elastic(cfg, topo), node=topo.node_rank)
        # torchrun waits for missing nodes without a word: say it, once (first attempt only).
        not_joined = partial(peers.not_joined, topo.nnodes) if restart is None else None
        # A node that refuses to join (started otherwise) ends the job, unless it can go on
        # without that node (`--min_nodes`): then only the other nodes are waited for.
        refused = peers.refused if topo.leader and cfg.run.min_nodes in (0, topo.nnodes) else None
        if topo.nnodes == 1:
            rc, stops = wait(proc, stops=stops)
        elif elastic(cfg, topo):
            rc, stops = wait(proc, None, peers.stopped_elsewhere, not_joined, refused, stops=stops)
        else:
            rc, stops = wait(
                proc, peers.check, peers.stopped_elsewhere, not_joined, refused, stops=stops
            )
    # Another node's console said none of them (None: rank 0's own, on this console, were).
    said = relay.last_words_said if relay is not None else None if topo.leader else set()
    return rc, stops, said
