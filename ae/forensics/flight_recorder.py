"""Writer: PyTorch's Flight Recorder in every rank, and its dump to
`logs/collectives_rank<N>_<TS>.json` (`ae.diagnose.flight_recorder` reads it).

The Flight Recorder keeps the last `TORCH_FR_BUFFER_SIZE` collectives of the process in a ring
buffer (process group, sequence id, op, sizes, dtypes, state, and the Python frames that issued
it); torch records gloo's there and NCCL's in a recorder of its own. `enable` turns it on before
the process group exists; `dump` writes both, merged, without any collective, so it works while
the job is stuck: the watchdog calls it at a rank's first STALL report and when `ae-diagnose
--dump` asks, and `ae.rank.exit` when the rank fails or is stopped. `ae.diagnose.collectives`
reads the files and aligns the ranks.

torch has no public function for the dump (torch.distributed.debug serves the same buffers over
HTTP, with extra packages): this module is the one place in ae that reaches into
`torch._C._distributed_c10d` (allowed by name in tests/test_architecture_public_api.py).
"""

from __future__ import annotations

import json
import os
import pickle
import re
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from loguru import logger

from ae import atomic_files
from ae.log_lines import COLLECTIVES_DUMPED, COLLECTIVES_FILE, OLD_TORCH_RECORDER

# Entries kept: several hundred steps of DDP (a gradient all-reduce per bucket and Lightning's
# signal broadcast per step; the step vote about four times a second). Recording one costs a few
# microseconds (bench/flight_recorder.py).
BUFFER_ENTRIES = 2000
BUFFER_ENV = ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE")
# The first torch whose Flight Recorder records gloo's collectives: 2.8 has the generic recorder in
# libtorch_cpu that ProcessGroupGloo writes to, and `_dump_fr_trace`; 2.7 has NCCL's alone. The
# floor of pyproject.toml; an older (pinned) torch runs, with a warning.
GLOO_RECORDED_SINCE = (2, 8)


_target: tuple[Path, int] | None = None  # (file, rank) once enabled


def enable(logs_dir: Path, rank: int, run_ts: str) -> None:
    """Turn the recorder on for the process groups created after this call (a buffer size the
    user set is kept), and say where `dump` writes. Python frames are recorded with each entry;
    C++ stacks stay off (costly)."""
    global _target
    if (warning := old_torch_warning(torch.__version__)) is not None:
        logger.warning(warning)
    if not any(os.environ.get(name) for name in BUFFER_ENV):
        os.environ[BUFFER_ENV[0]] = str(BUFFER_ENTRIES)
    _target = (collectives_path(logs_dir, rank, run_ts), rank)


def old_torch_warning(version: str) -> str | None:
    """The one-line warning for a torch whose Flight Recorder does not record gloo, else None."""
    m = re.match(r"(\d+)\.(\d+)", version)
    if m is None or (int(m[1]), int(m[2])) >= GLOO_RECORDED_SINCE:
        return None
    return OLD_TORCH_RECORDER.format(version=version, floor=".".join(map(str, GLOO_RECORDED_SINCE)))


def collectives_path(logs_dir: Path, rank: int, run_ts: str) -> Path:
    return Path(logs_dir) / COLLECTIVES_FILE.format(rank=rank, ts=run_ts)


def _recorders() -> dict[str, bytes]:
    """Each recorder's pickled dump, by name: the generic one (gloo's) from torch 2.8 on, the
    NCCL one only in builds that have it."""
    import torch._C._distributed_c10d as c10d  # private: see the module docstring

    out = {}
    if hasattr(c10d, "_dump_fr_trace"):
        out["generic"] = c10d._dump_fr_trace()
    if hasattr(c10d, "_dump_nccl_trace"):
        out["nccl"] = c10d._dump_nccl_trace()
    return out


def snapshot(rank: int, reason: str) -> dict[str, Any]:
    """The recorders' entries (both merged, each tagged with its recorder), with who and why."""
    entries: list[dict[str, Any]] = []
    pg_config: dict[str, Any] = {}
    pg_status: dict[str, Any] = {}
    for name, raw in _recorders().items():
        # Our own process's bytes, just made by torch: nothing foreign is unpickled.
        dump = pickle.loads(raw)
        pg_config.update(dump.get("pg_config") or {})
        pg_status.update(dump.get("pg_status") or {})
        entries.extend({**e, "recorder": name} for e in dump.get("entries") or [])
    return {
        "rank": rank,
        "pid": os.getpid(),
        "reason": reason,
        "time": time.time(),
        "pg_config": pg_config,
        "pg_status": pg_status,
        "entries": entries,
    }


def dump(reason: str) -> Path | None:
    """Write this rank's collectives file (replacing an older dump: the ring buffer holds the
    older entries too). Nothing before `enable` or without a process group; None, with a
    WARNING, when it cannot be made."""
    if _target is None or not (dist.is_available() and dist.is_initialized()):
        return None
    path, rank = _target
    try:
        doc = snapshot(rank, reason)
        # default=str: process-group names come as tuples, a few fields as non-JSON scalars
        atomic_files.write(path, json.dumps(doc, default=str).encode(), durable=False)
    except Exception as e:  # never let a dump take the rank (or its watchdog) down
        logger.warning(f"Collectives dump ({reason}) failed: {type(e).__name__}: {e}")
        return None
    entries = len(doc["entries"])
    logger.info(COLLECTIVES_DUMPED.format(reason=reason, entries=entries, file=path.name))
    return path
