"""The launcher behind ./train_ae.sh: validate flags, prepare data, then run torchrun.

Everything a user can get wrong is checked here, in about a second and before any worker process
exists: flags, the config file, shard specs. Then one torchrun per node starts the ranks:
`--nproc_per_node` from `--devices` (auto: all GPUs, else 2 CPU processes), and NNODES /
NODE_RANK / MASTER_ADDR / MASTER_PORT from the environment for multi-node runs.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from loguru import logger

import logging_cfg
from ae.config import Config, ConfigError, help_text, parse_config
from ae.demo_data import demo_shard_specs
from ae.log_lines import PREEMPTED
from ae.shard_spec import ShardSpecError, resolve_shards

TRAIN_SCRIPT = Path(__file__).resolve().parent.parent / "train_ae.py"
CPU_PROCESSES = 2
# Exit code after a SIGTERM (preemption): 128 + SIGTERM, what schedulers expect of a terminated job.
PREEMPTED_EXIT_CODE = 128 + signal.SIGTERM

# With --debug, the distributed libraries' own debug output, into each rank's native log; unless
# the user set them. Not TORCH_DISTRIBUTED_DEBUG=DETAIL: it checks every collective (slow).
DEBUG_ENV = {"NCCL_DEBUG": "INFO", "TORCH_CPP_LOG_LEVEL": "INFO", "TORCH_DISTRIBUTED_DEBUG": "INFO"}


def rank_command(debug: bool) -> list[str]:
    """torchrun's arguments naming what each rank runs. The debug variables are set for the ranks
    only (through `env`): in torchrun's own process they would flood the console."""
    debug_env = [f"{k}={v}" for k, v in DEBUG_ENV.items() if debug and k not in os.environ]
    if not debug_env:
        return [str(TRAIN_SCRIPT)]
    return ["--no-python", "env", *debug_env, sys.executable, "-u", str(TRAIN_SCRIPT)]


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


def processes_per_node(cfg: Config) -> tuple[int, list[str]]:
    problems = []
    gpus = visible_gpus() if cfg.accelerator != "cpu" else 0
    if cfg.accelerator == "gpu" and gpus == 0:
        problems.append("accelerator: gpu requested but no GPU is visible")
    if cfg.devices != "auto":
        n = int(cfg.devices)
        if gpus and cfg.accelerator != "cpu" and n > gpus:
            problems.append(f"devices: {n} requested but only {gpus} GPU(s) visible")
        return n, problems
    return (gpus if gpus else CPU_PROCESSES), problems


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def node_topology(cfg: Config) -> tuple[int, int, list[str]]:
    env = os.environ
    nnodes = int(env.get("NNODES", env.get("SLURM_NNODES", cfg.num_nodes)))
    node_rank = int(env.get("NODE_RANK", env.get("SLURM_NODEID", 0)))
    problems = []
    if nnodes > 1 and "MASTER_ADDR" not in env:
        problems.append("MASTER_ADDR: must be set (to node 0's address) for a multi-node run")
    if not 0 <= node_rank < nnodes:
        problems.append(f"NODE_RANK: must be in [0, {nnodes}); got {node_rank}")
    return nnodes, node_rank, problems


@contextmanager
def forward_sigterm(proc: subprocess.Popen) -> Iterator[list[bool]]:
    """Pass a SIGTERM on to torchrun once, and keep waiting for it to finish.

    `docker stop` and Kubernetes signal only a container's first process; torchrun then signals
    every rank, which saves a checkpoint and stops (`ae.preemption`). Yields a one-item list that
    turns True once a SIGTERM came."""
    received = [False]

    def handler(signum: int, frame: Any) -> None:
        if not received[0] and proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        received[0] = True

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield received
    finally:
        signal.signal(signal.SIGTERM, previous)


def report_preemption(train_log: Path) -> int:
    """After a SIGTERM: say whether the ranks saved a checkpoint (rank 0's PREEMPTED line)."""
    text = train_log.read_text(errors="replace") if train_log.is_file() else ""
    saved = [m for line in text.splitlines() if (m := PREEMPTED.parse(line))]
    if saved:
        logger.warning(
            f"Preempted (SIGTERM): checkpoint of step {saved[-1]['step']} saved at "
            f"{saved[-1]['path']}; resume with --resume_from_checkpoint=last"
        )
    else:  # killed before its save, or rank 0 runs on another node with its own train log
        logger.error(f"Preempted (SIGTERM): no saved checkpoint is reported in {train_log}")
    return PREEMPTED_EXIT_CODE


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    logging_cfg.configure_console()
    if "--help" in argv or "-h" in argv:
        logger.info(help_text())
        return 0
    try:
        cfg = parse_config(argv)
        nproc, problems = processes_per_node(cfg)
        nnodes, node_rank, topo_problems = node_topology(cfg)
        if problems + topo_problems:
            raise ConfigError(problems + topo_problems)
    except ConfigError as e:
        logger.error(e.render())
        return 2
    if cfg.print_config:
        # Data, not a log line: plain YAML on stdout, so `--print_config > run.yaml` works.
        sys.stdout.write(cfg.to_yaml())
        return 0
    try:
        train_urls, _ = resolve_shards(cfg.train_shards, cfg.val_shards)
    except ShardSpecError as e:
        logger.error(ConfigError(str(e).splitlines()).render())
        return 2

    extra = [f"--devices={nproc}", f"--num_nodes={nnodes}"]
    if cfg.train_shards is None or cfg.val_shards is None:  # the demo data, built once above
        demo_train, demo_val = demo_shard_specs()
        extra += [f"--train_shards={cfg.train_shards or demo_train}"]
        extra += [f"--val_shards={cfg.val_shards or demo_val}"]
    env = dict(os.environ)
    ts = env.setdefault("AE_RUN_TS", time.strftime("%Y%m%d_%H%M%S"))
    addr = env.get("MASTER_ADDR", "127.0.0.1")
    port = env.get("MASTER_PORT") or str(free_port() if nnodes == 1 else 29500)
    logs = cfg.logs_dir
    where = f"node {node_rank}/{nnodes}, " if nnodes > 1 else ""
    logger.info(
        f"Training on {where}{nproc} process(es) per node, {len(train_urls)} train shards"
        f"\n  train log : {logs}/train_{ts}.log"
        f"\n  rank logs : {logs}/debug_rank*_{ts}.log"
        f"\n  native    : {logs}/native_rank*_{ts}.log (NCCL, gloo, C extensions)"
        f"\n  follow    : tail -f {logs}/debug_rank*_{ts}.log"
    )
    cmd = [
        sys.executable, "-m", "torch.distributed.run",
        f"--nnodes={nnodes}", f"--node_rank={node_rank}", f"--nproc_per_node={nproc}",
        f"--master_addr={addr}", f"--master_port={port}",
        *rank_command(cfg.debug), *argv, *extra,
    ]  # fmt: skip
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    proc = subprocess.Popen(cmd, env=env)
    try:
        with forward_sigterm(proc) as preempted:
            rc = proc.wait()
    except KeyboardInterrupt:
        rc = 130
    if preempted[0]:
        return report_preemption(logs / f"train_{ts}.log")
    if rc == 0:
        logger.info(f"Done. Logs: {logs}/ (run {ts})")
    else:
        logger.error(
            f"Training failed (exit {rc}). Errors of every rank: grep ERROR {logs}/train_{ts}.log"
        )
    return rc


if __name__ == "__main__":
    sys.exit(main())
