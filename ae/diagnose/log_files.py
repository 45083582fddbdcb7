"""The files of a run in a logs folder, grouped by run timestamp, and which run is the newest.

File names come from ae.log_lines (the same formats logging_cfg writes them with): the train log,
one debug and one native log per rank, one heartbeat per rank, and torchrun's own output
(`launcher_<TS>.log`), and each rank's Flight Recorder dump (`collectives_rank<N>_<TS>.json`);
rotated logs carry `.1`, `.2` ... (`.1` the newest of them).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path

from ae.errors import UserError
from ae.log_lines import (
    COLLECTIVES_FILE,
    DEBUG_LOG_FILE,
    HEARTBEAT_FILE,
    LAUNCHER_LOG_FILE,
    NATIVE_LOG_FILE,
    TRAIN_LOG_FILE,
)

_ROTATED = re.compile(r"(?P<base>.+\.log)\.(?P<n>\d+)")


class DiagnoseError(UserError):
    """A user mistake (no such folder, no run in it, unknown --run): one message, no traceback."""


@dataclass
class RunFiles:
    logs_dir: Path
    ts: str
    train_logs: list[Path] = field(default_factory=list)  # oldest first
    debug_logs: dict[int, list[Path]] = field(default_factory=dict)  # rank -> oldest first
    native_logs: dict[int, list[Path]] = field(default_factory=dict)
    heartbeats: dict[int, Path] = field(default_factory=dict)
    launcher_logs: list[Path] = field(default_factory=list)  # torchrun's report, when it ran
    collectives: dict[int, Path] = field(default_factory=dict)  # rank -> its last dump

    def all_files(self) -> list[Path]:
        files = [*self.train_logs, *self.launcher_logs]
        for group in (self.debug_logs, self.native_logs):
            for rank in sorted(group):
                files += group[rank]
        files += [self.heartbeats[r] for r in sorted(self.heartbeats)]
        return files + [self.collectives[r] for r in sorted(self.collectives)]

    def newest_mtime(self) -> float:
        return max((p.stat().st_mtime for p in self.all_files()), default=0.0)


def resolve_logs_dir(path: Path) -> Path:
    """The logs folder itself, a run's output folder with `logs/` below it, or the folder of one
    of a run's files (`run_of_file` says which run)."""
    if not path.exists():
        raise DiagnoseError(f"no such folder: {path} (give a run's logs folder, <output_dir>/logs)")
    if path.is_file() and run_of_file(path) is not None:
        return path.parent
    if not path.is_dir():
        raise DiagnoseError(
            f"not a folder, nor a file of a run: {path} (give a run's logs folder, "
            "<output_dir>/logs, or one of its log files)"
        )
    if (path / "logs").is_dir() and not list_runs(path):
        return path / "logs"
    return path


def _classify(name: str) -> tuple[str, str, int | None, int] | None:
    """(kind, ts, rank, rotation) of a file name, or None for a file that is not ours."""
    rotation = 0
    if m := _ROTATED.fullmatch(name):
        name, rotation = m["base"], int(m["n"])
    kinds = (
        ("train", TRAIN_LOG_FILE),
        ("debug", DEBUG_LOG_FILE),
        ("native", NATIVE_LOG_FILE),
        ("heartbeat", HEARTBEAT_FILE),
        ("launcher", LAUNCHER_LOG_FILE),
        ("collectives", COLLECTIVES_FILE),
    )
    for kind, fmt in kinds:
        if m := fmt.regex.fullmatch(name):
            rank = int(m["rank"]) if "rank" in fmt.types else None
            return kind, m["ts"], rank, rotation
    return None


def run_of_file(path: Path) -> str | None:
    """The run TS of one of a run's files (`debug_rank1_<TS>.log`, a heartbeat, ...), or None."""
    found = _classify(path.name)
    return found[1] if found is not None else None


def list_runs(logs_dir: Path) -> dict[str, RunFiles]:
    found: dict[str, list[tuple[int, str, int | None, Path]]] = {}
    with os.scandir(logs_dir) as entries:
        for entry in entries:
            if not entry.is_file() or (c := _classify(entry.name)) is None:
                continue
            kind, ts, rank, rotation = c
            found.setdefault(ts, []).append((-rotation, kind, rank, Path(entry.path)))
    runs = {}
    for ts, files in found.items():
        run = RunFiles(logs_dir, ts)
        for _, kind, rank, path in sorted(files, key=lambda f: f[0]):  # oldest rotation first
            if kind == "train":
                run.train_logs.append(path)
            elif kind == "launcher":
                run.launcher_logs.append(path)
            elif kind == "heartbeat":
                run.heartbeats[rank] = path  # type: ignore[index]
            elif kind == "collectives":
                run.collectives[rank] = path  # type: ignore[index]
            else:
                group = run.debug_logs if kind == "debug" else run.native_logs
                group.setdefault(rank, []).append(path)  # type: ignore[arg-type]
        runs[ts] = run
    return runs


def find_run(logs_dir: Path, ts: str | None = None) -> RunFiles:
    """The run `ts`, or the newest run (by its files' modification times) in `logs_dir`."""
    runs = list_runs(logs_dir)
    if not runs:
        raise DiagnoseError(
            f"no run in {logs_dir}: no train_<TS>.log, debug_rank<N>_<TS>.log or heartbeat files"
        )
    if ts is None:
        return max(runs.values(), key=RunFiles.newest_mtime)
    if ts not in runs:
        newest = sorted(runs.values(), key=RunFiles.newest_mtime, reverse=True)[:5]
        raise DiagnoseError(
            f"no run {ts} in {logs_dir}; newest runs: {', '.join(r.ts for r in newest)}"
        )
    return runs[ts]
