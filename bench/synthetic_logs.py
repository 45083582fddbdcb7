"""Synthetic run logs written with the real line formats (ae.log_lines), for ae-diagnose tests
and bench/diagnose_bench.py: a record is RECORD_FORMAT, a message is the writers' LineFormat.

Here, not in the product package, and not in tests/support: bench must not import from tests,
tests may import bench (as with `bench.real_images`)."""

from __future__ import annotations

import json
import socket
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

from ae.log_lines import (
    DEBUG_LOG_FILE,
    FATAL,
    HEARTBEAT_FIELDS,
    HEARTBEAT_FILE,
    NONFINITE,
    NONFINITE_RECEIVED,
    PROCESSED_TRAIN,
    RANK_EXIT,
    RANK_PROCESS,
    RECORD_FORMAT,
    RESOLVED_CONFIG,
    SHARD_PLAN,
    STALL,
    STALL_REPORT,
    STALL_RESOLVED,
    TRAIN_LOG_FILE,
    TRAIN_STEP,
    epoch_marker,
)

# RECORD_FORMAT is loguru's; the same layout as a str.format template.
_RECORD = RECORD_FORMAT.replace("{time:YYYY-MM-DD HH:mm:ss.SSS}", "{time}").replace(
    "{extra[tag]}", "{tag}"
)
# A heartbeat's resources on a machine with room to spare (MB; counts).
ROOMY = {
    "shm_free_mb": 8000.0, "shm_total_mb": 8192.0, "disk_free_mb": 200000.0,
    "disk_total_mb": 500000.0, "mem_available_mb": 50000.0, "mem_total_mb": 64000.0,
    "cgroup_limit_mb": None, "oom_kills": 0, "oom_kills_at_start": 0, "open_fds": 40,
    "fd_limit": 65536,
}  # fmt: skip
T0 = datetime(2026, 11, 21, 12, 0, 0).timestamp()
TS = "20261121_120000"


def record(t: float, level: str, rank: int, world: int, message: str, worker: str = "") -> str:
    tag = f"[Rank {rank}/{world}{f' Worker {worker}' if worker else ''}]"
    when = datetime.fromtimestamp(t).strftime("%Y-%m-%d %H:%M:%S.%f")[:-3]
    return _RECORD.format(time=when, level=level, tag=tag, message=message)


@dataclass
class RankWriter:
    """Appends records of one rank to its debug log; `t` is the clock, advanced by `dt`."""

    logs: Path
    rank: int
    world: int
    t: float = T0
    ts: str = TS
    lines: list[str] = field(default_factory=list)

    @property
    def path(self) -> Path:
        return self.logs / DEBUG_LOG_FILE.format(rank=self.rank, ts=self.ts)

    def log(self, message: str, level: str = "INFO", dt: float = 0.01, worker: str = "") -> None:
        self.t += dt
        self.lines.append(record(self.t, level, self.rank, self.world, message, worker))

    def raw(self, *lines: str) -> None:
        """Continuation lines: tracebacks, stacks, faulthandler output."""
        self.lines.extend(lines)

    def flush(self) -> Path:
        self.logs.mkdir(parents=True, exist_ok=True)
        with self.path.open("a") as f:
            f.write("".join(line + "\n" for line in self.lines))
        self.lines.clear()
        return self.path

    # --- what a rank writes -----------------------------------------------------------------
    def start(self, batches: int = 15, host: str = "node0") -> None:
        self.log("==================== RANK HEADER ====================")
        self.log(RANK_PROCESS.format(pid=f"1234{self.rank}", host=host, python="3.11.7"))
        for split, n in (("train", batches), ("val", 2)):
            plan = SHARD_PLAN.format(split=split, shards=3, samples=240, batches=n, batch_size=8,
                                     ranks=self.world, workers=1, mode="drop", dropped=0,
                                     repeated=0, rank_samples=n * 8,
                                     worker_batches=str(n))  # fmt: skip
            self.log(plan)

    def steps(self, first: int, last: int, epoch: int = 0, dt: float = 0.05) -> None:
        for step in range(first, last + 1):
            detail = ", lr=0.001, 300 samples/s, rss=400MB workers=1x300MB"
            self.log(TRAIN_STEP.format(step=step, loss="0.25", detail=detail), "DEBUG", dt)

    def epoch(self, epoch: int, first: int, last: int) -> None:
        self.log(epoch_marker(epoch, "TRAINING", "START"))
        self.steps(first, last, epoch)
        self.log(PROCESSED_TRAIN.format(batches=last - first + 1, epoch=epoch, rate="20.0"))
        self.log(epoch_marker(epoch, "TRAINING", "END"))
        self.log(epoch_marker(epoch, "VALIDATION", "START"))
        self.log(epoch_marker(epoch, "VALIDATION", "END"))

    def exit(self, code: int = 0, why: str = "training finished") -> None:
        self.log(RANK_EXIT.format(code=code, why=why))

    def nonfinite(self, step: int, shard: str, peers: tuple[RankWriter, ...] = ()) -> None:
        """This rank's loss turned NaN at `step` (its batch `step - 1`, epoch 0, from `shard`);
        `peers` got it through the all-reduce."""
        self.log(NONFINITE.format(value="loss=nan", rank=self.rank, step=step, epoch=0,
                                  batch=str(step - 1), samples=f"shard {shard}, keys [a]"),
                 "ERROR")  # fmt: skip
        for peer in peers:
            peer.log(NONFINITE_RECEIVED.format(step=step), "WARNING")

    def stall(self, phase: str, step: int, idle: float, collective: str = "no",
              frame: str = "_injected_sleep (ae/forensics/faults.py:120)", report: int = 1,
              worker_frame: str | None = None) -> None:  # fmt: skip
        self.t += idle
        self.log(STALL.format(idle=f"{idle:.1f}", phase=phase, epoch=0, step=step, report=report,
                              frame=frame, collective=collective), "WARNING", dt=0)  # fmt: skip
        head = STALL_REPORT.format(report=report, rank=self.rank, pid=1234, idle=idle, phase=phase)
        self.log(head)
        self.raw(f"main thread in: {frame}; collective wait: {collective}", "processes:",
                 "  rank    pid=1234 status=sleeping rss=400MB cpu=0% cpu_time=3.0s fds=40",
                 "stacks (all threads but the watchdog):", "Thread MainThread (ident 1):",
                 '  File "/x/train_ae.py", line 99, in <module>')  # fmt: skip
        if worker_frame is not None:  # an idle worker, then the busy one (faulthandler dumps)
            self.raw(
                "Thread 0x00007f0000000002 (most recent call first):",
                '  File "/x/threading.py", line 327 in wait',
                "",
                "Current thread 0x00007f0000000001 (most recent call first):",
                '  File "/x/selectors.py", line 415 in select',
                '  File "/x/multiprocessing/queues.py", line 113 in get',
                '  File "/x/torch/utils/data/_utils/worker.py", line 334 in _worker_loop',
                "",
                "Current thread 0x00007f0000000003 (most recent call first):",
                f'  File "/x/ae/forensics/faults.py", line 120 in {worker_frame}',
                '  File "/x/ae/data/stream/shard_stream.py", line 140 in __iter__',
                '  File "/x/torch/utils/data/_utils/fetch.py", line 33 in fetch',
                '  File "/x/torch/utils/data/_utils/worker.py", line 349 in _worker_loop',
            )
            self.log(f"STALL report {report}: dataloader workers [1, 2] dumped their stacks above "
                     "(faulthandler)")  # fmt: skip

    def resolved(self, phase: str, step: int, idle: float, now: str = "") -> None:
        now = now or f"phase {phase}, step {step + 1}"
        line = STALL_RESOLVED.format(idle=idle, phase=phase, epoch=0, step=step, now=now)
        self.log(line, "WARNING")

    def fatal(self, exc_type: str, message: str, frames: list[tuple[str, str]],
              where: str = "main thread", worker: str = "") -> None:  # fmt: skip
        """A FATAL record and its traceback; `frames`: (path, function), outermost first."""
        line = FATAL.format(exc_type=exc_type, where=where, message=message)
        self.log(line, "CRITICAL", worker=worker)
        self.raw("Traceback (most recent call last):")
        for i, (path, func) in enumerate(frames):
            self.raw(f'  File "{path}", line {10 + i}, in {func}', "    do_something()",
                     "    └ <function do_something at 0x7f>")  # fmt: skip
        self.raw("", f"{exc_type}: {message}")

    def segfault(self, frames: list[tuple[str, str]]) -> None:
        """faulthandler's output; `frames` innermost first."""
        self.raw("Fatal Python error: Segmentation fault", "",
                 "Current thread 0x00007fbdcd453b80 (most recent call first):")  # fmt: skip
        self.raw(*(f'  File "{path}", line 7 in {func}' for path, func in frames))
        self.raw("", "Extension modules: numpy._core._multiarray_umath, torch._C")


def write_train_log(
    logs: Path, world: int, stall_timeout: float = 3.0, ts: str = TS, num_workers: int = 2
) -> Path:
    lines = [
        record(T0, "INFO", 0, world, f"Setup: distributed, world size {world}"),
        record(T0, "INFO", 0, world, RESOLVED_CONFIG),
        "batch_size: 8",
        f"num_workers: {num_workers}",
        f"stall_timeout: {stall_timeout}",
    ]
    path = logs / TRAIN_LOG_FILE.format(ts=ts)
    logs.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n")
    return path


def write_heartbeat(logs: Path, rank: int, world: int, *, pid: int, t: float, phase: str,
                    step: int, state: str = "running", stalled: bool = False,
                    last_progress: float | None = None, host: str | None = None,
                    ts: str = TS, timing: dict | None = None, data_workers: list | None = None,
                    stragglers: list | None = None, resources: dict | None = None,
                    main: str | None = None) -> Path:  # fmt: skip
    """`timing`: {"recent": ..., "epoch": ...} windows as ae.forensics.step_times writes them;
    `resources`: RESOURCE_FIELDS figures that differ from a roomy machine's."""
    beat = {
        "rank": rank, "world_size": world, "pid": pid, "host": host or socket.gethostname(),
        "phase": phase, "epoch": 0, "step": step, "time": t,
        "last_progress": t if last_progress is None else last_progress, "idle_s": 0.0,
        "rss_mb": 400.0, "workers": [{"pid": pid + 1, "rss_mb": 300.0}], "stalled": stalled,
        "state": state, "timing": timing or {"recent": None, "epoch": None},
        "data_workers": data_workers or [], "stragglers": stragglers or [],
        "resources": {**ROOMY, **(resources or {})},
        "main": main or ("data loading" if phase == "data loading" else "code: step (model.py:1)"),
    }  # fmt: skip
    assert tuple(beat) == HEARTBEAT_FIELDS
    path = logs / HEARTBEAT_FILE.format(rank=rank, ts=ts)
    path.write_text(json.dumps(beat))
    return path
