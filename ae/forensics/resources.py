"""Writer: the machine's limits as one rank sees them, for its heartbeat's `resources` (read by
`ae.diagnose.resources`) and the preflight, cheaply: free `/dev/shm`, free disk of the output
folder, available host memory, the cgroup's memory limit and OOM-kill count, open descriptors.

Read by the preflight (`ae.job.preflight`) and every heartbeat (`resources` field); each figure is
one `statvfs`, one small `/proc` or `/sys` read, or one `listdir` (tens of microseconds in all).
Torch-free: the launcher reads them too. A figure the kernel does not expose is None.
"""

from __future__ import annotations

import contextlib
import os
import resource
from pathlib import Path
from typing import Any

from ae.atomic_files import Space, fs_space

SHM = Path("/dev/shm")
CGROUP_ROOT = Path("/sys/fs/cgroup")
_MB = 2**20
_NO_LIMIT = 2**60  # cgroup v1 writes ~2^63 for "no limit"


def host_memory() -> Space | None:
    """MemAvailable and MemTotal of /proc/meminfo, in bytes."""
    try:
        with open("/proc/meminfo", "rb") as f:
            text = f.read(512).decode()
    except OSError:
        return None
    fields = dict(line.split(":", 1) for line in text.splitlines() if ":" in line)
    try:
        return Space(
            int(fields["MemAvailable"].split()[0]) * 1024, int(fields["MemTotal"].split()[0]) * 1024
        )
    except (KeyError, ValueError, IndexError):
        return None


def _cgroup_dir() -> tuple[Path, str] | None:
    """This process's memory cgroup folder and its version ("v2" or "v1"): the path named in
    /proc/self/cgroup when it exists under the mount, else the mount itself (a container's view)."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        hid, controllers, rel = line.split(":", 2)
        if "memory" in controllers.split(","):  # v1
            base = CGROUP_ROOT / "memory"
            for d in (base / rel.lstrip("/"), base):
                if (d / "memory.limit_in_bytes").is_file():
                    return d, "v1"
        if hid == "0" and controllers == "":  # v2 (unified)
            for d in (CGROUP_ROOT / rel.lstrip("/"), CGROUP_ROOT):
                if (d / "memory.events").is_file():
                    return d, "v2"
    return None


class CgroupMemory:
    """The memory limit and OOM-kill count of this process's cgroup (v2 `memory.max` and
    `memory.events`, v1 `memory.limit_in_bytes` and `memory.oom_control`). The folder is found
    once; each read is one small file."""

    def __init__(self) -> None:
        self.pid = -1
        self.found: tuple[Path, str] | None = None

    def _where(self) -> tuple[Path, str] | None:
        if self.pid != os.getpid():  # a forked process may sit in another cgroup
            self.pid, self.found = os.getpid(), _cgroup_dir()
        return self.found

    def _read(self, v2: str, v1: str) -> str | None:
        """The text of the cgroup file named `v2` under cgroup v2, `v1` under v1."""
        if (where := self._where()) is None:
            return None
        d, version = where
        try:
            return (d / (v2 if version == "v2" else v1)).read_text()
        except OSError:
            return None

    def limit(self) -> int | None:
        text = (self._read("memory.max", "memory.limit_in_bytes") or "").strip()
        if not text.isdigit() or int(text) >= _NO_LIMIT:  # "max", or v1's "no limit"
            return None
        return int(text)

    def oom_kills(self) -> int | None:
        for line in (self._read("memory.events", "memory.oom_control") or "").splitlines():
            key, _, value = line.partition(" ")
            if key == "oom_kill" and value.strip().isdigit():
                return int(value)
        return None


cgroup_memory = CgroupMemory()


def open_fds() -> int | None:
    with contextlib.suppress(OSError):
        return len(os.listdir("/proc/self/fd"))
    return None


def fd_limit() -> int:
    """The soft `ulimit -n` of this process."""
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


def _mb(n: int | None) -> float | None:
    return None if n is None else round(n / _MB, 1)


class ResourceReader:
    """The heartbeat's `resources`: free /dev/shm and output-folder disk, host memory, the
    cgroup's limit and OOM kills (with the count when the rank started), open fds and the limit."""

    def __init__(self, output_dir: Path) -> None:
        self.output_dir = Path(output_dir)
        self.oom_kills_at_start = cgroup_memory.oom_kills()

    def sample(self) -> dict[str, Any]:
        shm, disk, mem = fs_space(SHM), fs_space(self.output_dir), host_memory()
        return {
            "shm_free_mb": _mb(shm.free) if shm else None,
            "shm_total_mb": _mb(shm.total) if shm else None,
            "disk_free_mb": _mb(disk.free) if disk else None,
            "disk_total_mb": _mb(disk.total) if disk else None,
            "mem_available_mb": _mb(mem.free) if mem else None,
            "mem_total_mb": _mb(mem.total) if mem else None,
            "cgroup_limit_mb": _mb(cgroup_memory.limit()),
            "oom_kills": cgroup_memory.oom_kills(),
            "oom_kills_at_start": self.oom_kills_at_start,
            "open_fds": open_fds(),
            "fd_limit": fd_limit(),
        }
