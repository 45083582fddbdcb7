"""Who is logging: global rank, world size, and dataloader worker, for the `[Rank r/W]` tag."""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass


@dataclass(frozen=True)
class RankContext:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    node_rank: int = 0

    @classmethod
    def from_env(cls) -> RankContext:
        """torchrun (and SLURM via srun) describe the process in the environment."""
        env = os.environ
        rank = int(env.get("RANK", env.get("SLURM_PROCID", 0)))
        world = int(env.get("WORLD_SIZE", env.get("SLURM_NTASKS", 1)))
        local = int(env.get("LOCAL_RANK", env.get("SLURM_LOCALID", 0)))
        node = int(env.get("GROUP_RANK", env.get("NODE_RANK", env.get("SLURM_NODEID", 0))))
        return cls(rank=rank, world_size=world, local_rank=local, node_rank=node)

    def install(self) -> None:
        global _current
        _current = self


_current = RankContext()
_rank_tag_cache: dict[int | None, str] = {}


def worker_info() -> tuple[int, int] | None:
    # Only consult torch when it is already imported: a process without it has no workers.
    data_mod = sys.modules.get("torch.utils.data")
    if data_mod is None:
        return None
    info = data_mod.get_worker_info()
    return None if info is None else (info.id, info.num_workers)


def rank_tag() -> str:
    """`[Rank r/W]`, or `[Rank r/W Worker w/K]` inside a dataloader worker process."""
    w = worker_info()
    key = None if w is None else w[0]
    tag = _rank_tag_cache.get(key)
    if tag is None:
        c = _current
        tag = f"[Rank {c.rank}/{c.world_size}]"
        if w is not None:
            tag = f"[Rank {c.rank}/{c.world_size} Worker {w[0]}/{w[1]}]"
        _rank_tag_cache[key] = tag
    return tag


def resolve_run_ts(ctx: RankContext, timeout_s: float = 60.0) -> str:
    """One `YYYYmmdd_HHMMSS` for every rank of the run, across nodes.

    The launcher agrees on it for the whole job (across nodes through the run folder's lock
    file) and exports it as AE_RUN_TS: then that is the run's TS. Ranks started by hand
    (`torchrun train_ae.py` on each node) agree under torchrun's static rendezvous: the first rank
    to arrive publishes its TS in the agent's TCPStore (MASTER_ADDR:MASTER_PORT) and every other
    rank adopts it.
    """
    env = os.environ
    if env.get("AE_RUN_TS"):
        return env["AE_RUN_TS"]
    local_ts = time.strftime("%Y%m%d_%H%M%S")
    if ctx.world_size <= 1 or env.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return local_ts
    from datetime import timedelta

    from torch.distributed import TCPStore

    store = TCPStore(
        env["MASTER_ADDR"],
        int(env["MASTER_PORT"]),
        is_master=False,
        timeout=timedelta(seconds=timeout_s),
    )
    run_id = env.get("TORCHELASTIC_RUN_ID", "none")
    key = f"ae/run_ts/{run_id}/{env.get('TORCHELASTIC_RESTART_COUNT', '0')}"
    return store.compare_set(key, "", local_ts).decode()
