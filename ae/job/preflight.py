"""Preflight: the machine's limits against what the run will need, before the first batch.

Run twice: by the launcher (open files, disk for the logs, host memory for the ranks; it does not
know the batch or the model yet, and stays torch-free) and by every rank before `fit` with the
measured figures (batch bytes from the input shape, checkpoint bytes from the model's state
dict). A need above what there is stops the run with a `ResourceLimitError` naming the resource,
its size, the need and the fix; a need above TIGHT of it is a `Resource tight:` WARNING with the
same numbers, from the ranks' reckoning alone (logged by local rank 0 only): the launcher's, from
base sizes, would put a second, different figure for the same resource on the console. A few
`statvfs` and `/proc` reads: well under 1 ms.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ae.atomic_files import fs_space
from ae.config import Config
from ae.config.weight_files import fid_missing_problem, missing_problem
from ae.errors import ResourceLimitError
from ae.forensics.resources import SHM, cgroup_memory, fd_limit, host_memory

MB = 2**20
TIGHT = 0.8  # a need above this share of what there is: a warning
SHM_MARGIN = 1.25  # batches in flight, plus the collate copies and torch's own segments
LOG_BYTES = 64 * MB  # logs of a run (debug, native, train, heartbeats), unrotated, roughly
WORKER_BASE_BYTES = 150 * MB  # a dataloader worker's own memory beyond what it shares
RANK_BASE_BYTES = 600 * MB  # a rank with torch and Lightning imported, before the model
# Open files of a process besides the data: python, torch's libraries, logs, pipes.
BASE_FDS = 128
FDS_PER_PEER = 4  # gloo/NCCL sockets and the store, per other rank
FDS_PER_WORKER = 8  # pipes and queues to each dataloader worker, and its shard


@dataclass(frozen=True)
class Need:
    """`need` of `resource` against `have` (bytes, or a count): `how` the need was reckoned,
    `fix` what to change."""

    resource: str
    have: int | None  # None: not known here (no check)
    need: int
    how: str
    fix: str
    count: bool = False  # a number of things, not bytes

    def amount(self, n: int) -> str:
        return str(n) if self.count else size(n)

    def describe(self) -> str:
        assert self.have is not None
        return (
            f"{self.resource}: {self.amount(self.have)} available, the run needs about "
            f"{self.amount(self.need)} ({self.how}); fix: {self.fix}"
        )


def size(n: float) -> str:
    return f"{n / MB:.1f} MB" if n < 10 * 2**30 else f"{n / 2**30:.1f} GB"


def shm_size_flag(need: int) -> str:
    """`--shm-size=` for docker, rounded up to a power of two MB, twice the need."""
    mb = 64
    while mb * MB < 2 * need:
        mb *= 2
    return f"{mb}m" if mb < 1024 else f"{mb // 1024}g"


def shm_need(batch_bytes: int, workers: int, local_ranks: int, prefetch: int) -> Need:
    """Dataloader workers hand every batch to their rank through /dev/shm: up to `prefetch`
    batches per worker at once (a train worker's reused buffers, one more than `prefetch`, are
    within the margin)."""
    shm = fs_space(SHM)
    need = int(batch_bytes * prefetch * workers * local_ranks * SHM_MARGIN)
    how = (
        f"batch {size(batch_bytes)} x prefetch_factor {prefetch} x {workers} workers x "
        f"{local_ranks} local ranks, +{SHM_MARGIN - 1:.0%}"
    )
    fix = (
        f"a larger /dev/shm (docker run --shm-size={shm_size_flag(need)}; or mount -o "
        "remount,size=... /dev/shm), a smaller --batch_size, or fewer --num_workers"
    )
    have = shm.free if shm is not None and workers > 0 else None
    return Need(f"shared memory {SHM}", have, need, how, fix)


def disk_need(output_dir: Path, checkpoint_bytes: int, keep: int, best: bool) -> Need:
    """The checkpoints kept at once (the newest `keep`, one more while it is written, best) and
    the logs, on the output folder's filesystem."""
    files = keep + 1 + int(best)
    how = (
        f"checkpoint {size(checkpoint_bytes)} x {files} (--checkpoints_total_limit={keep}, one "
        f"being written{', best.ckpt' if best else ''}) + logs {size(LOG_BYTES)}"
    )
    fix = "free space there, another --output_dir, or a smaller --checkpoints_total_limit"
    return _disk(output_dir, checkpoint_bytes * files + LOG_BYTES, how, fix)


def logs_disk_need(output_dir: Path) -> Need:
    """The logs alone: the launcher's reckoning, before the model (and so a checkpoint's size)
    is known; the ranks check the checkpoints too (`disk_need`)."""
    return _disk(
        output_dir,
        LOG_BYTES,
        f"logs {size(LOG_BYTES)}",
        "free space there, or another --output_dir",
    )


def _disk(output_dir: Path, need: int, how: str, fix: str) -> Need:
    disk = fs_space(output_dir)
    return Need(f"disk of {output_dir}", disk.free if disk else None, need, how, fix)


def memory_available() -> int | None:
    """Host MemAvailable, or the cgroup's limit if lower (usage within it is not subtracted:
    the ranks already running are in MemAvailable, not in a fresh limit)."""
    mem = host_memory()
    limit = cgroup_memory.limit()
    figures = [x for x in (mem.free if mem else None, limit) if x is not None]
    return min(figures) if figures else None


def memory_need(rank_bytes: int, worker_bytes: int, workers: int, local_ranks: int) -> Need:
    need = local_ranks * (rank_bytes + workers * worker_bytes)
    how = (
        f"{local_ranks} local ranks x ({size(rank_bytes)} + {workers} workers x "
        f"{size(worker_bytes)})"
    )
    fix = "fewer --num_workers, fewer processes per node (--devices), or a smaller model"
    return Need("host memory", memory_available(), need, how, fix)


def fd_need(workers: int, world_size: int, prefetch: int) -> Need:
    """Per rank process: its own files, a few sockets per peer, and per worker its pipes and one
    descriptor per tensor in flight (torch shares tensors between processes by descriptor)."""
    need = BASE_FDS + FDS_PER_PEER * (world_size - 1) + workers * (FDS_PER_WORKER + prefetch)
    how = (
        f"{BASE_FDS} + {FDS_PER_PEER} x {world_size - 1} peers + {workers} workers x "
        f"({FDS_PER_WORKER} + prefetch_factor {prefetch})"
    )
    return Need("open files (ulimit -n)", fd_limit(), need, how, "ulimit -n 65536", count=True)


def launcher_needs(cfg: Config, local_ranks: int, world_size: int, prefetch: int) -> list[Need]:
    """What the launcher can reckon before any rank exists: open files per rank, the logs' disk,
    the memory of the ranks and workers (their base sizes; the model is not known yet)."""
    workers = cfg.data.num_workers
    return [
        fd_need(workers, world_size, prefetch),
        logs_disk_need(cfg.run.dir.root),
        memory_need(RANK_BASE_BYTES, WORKER_BASE_BYTES, workers, local_ranks),
    ]


def rank_needs(
    cfg: Config, *, batch_bytes: int, state_bytes: int, local_ranks: int, world_size: int,
    prefetch: int,
) -> list[Need]:  # fmt: skip
    """Every resource with the measured figures: a batch's bytes, the model's state dict bytes.
    A checkpoint holds the weights and the optimizer's two moments (3x the state dict); a rank
    will grow by the gradients and those moments; a worker holds its prefetched batches."""
    workers, ckpt = cfg.data.num_workers, cfg.checkpoints
    worker_bytes = WORKER_BASE_BYTES + prefetch * batch_bytes
    return [
        shm_need(batch_bytes, workers, local_ranks, prefetch),
        disk_need(cfg.run.dir.root, 3 * state_bytes, ckpt.checkpoints_total_limit, ckpt.save_best),
        memory_need(3 * state_bytes, worker_bytes, workers, local_ranks),
        fd_need(workers, world_size, prefetch),
    ]


def weights_problems(cfg: Config) -> list[str]:
    """A weights file the flags need and that is missing: `--perceptual_weight` > 0 (LPIPS) or
    `--fid_weights` (rFID); one message per flag naming each file, where it goes and how to
    fetch it (nothing is downloaded at run time)."""
    objective, problems = cfg.objective, []
    lpips = missing_problem(objective.perceptual_weights) if objective.perceptual_weight else None
    if lpips is not None:
        problems.append(f"perceptual_weights: {lpips}")
    fid = fid_missing_problem(objective.fid_weights) if objective.fid_weights else None
    if fid is not None:
        problems.append(f"fid_weights: {fid}")
    return problems


def judge(needs: list[Need]) -> tuple[list[str], list[str]]:
    """(problems that stop the run, tight limits to warn about)."""
    problems, tight = [], []
    for n in needs:
        if n.have is None:
            continue
        if n.need > n.have:
            problems.append(n.describe())
        elif n.need > TIGHT * n.have:
            tight.append(n.describe())
    return problems, tight


def check(needs: list[Need]) -> list[str]:
    """Raise ResourceLimitError for needs that cannot be met; return the tight ones' lines."""
    problems, tight = judge(needs)
    if problems:
        raise ResourceLimitError(problems)
    return tight
