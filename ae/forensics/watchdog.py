"""Per-rank stall watchdog: a daemon thread that watches `ae.forensics.progress` and reports stalls.

With `--hang_timeout`, a rank stalled that long writes a final report and exits with its own
code (`HANG_EXIT_CODE`), so that the launcher restarts the job or ends it with the verdict.

When the rank makes no progress (no beat) for `stall_timeout` seconds, it logs a one-line
`STALL detected` WARNING (also in train_<TS>.log) and a full `STALL report` in the rank's debug
log: main-thread frame, collective-wait guess, process table (rank and workers), CUDA memory,
all-thread stacks, then each forked dataloader worker dumps its own stacks; the first report of a
stall also dumps the rank's recent collectives (`ae.forensics.flight_recorder`), and so does each
new `ae-diagnose --dump` request file it finds. While the stall lasts
the report repeats with back-off (at T, 2T, 4T, ... of idle time, at most an hour apart); when a
beat comes again it logs `STALL RESOLVED`. Along the way it rewrites the rank's heartbeat file,
and, before each write, looks for stragglers (`ae.forensics.stragglers`).

Nothing here calls a collective, so every rank reports on its own even when the job is hung: the
stuck rank and the ranks waiting for it in a collective (those say `collective wait: yes`).
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from pathlib import Path

import torch
from loguru import logger

import logging_cfg
from ae.atomic_files import fs_space
from ae.forensics import flight_recorder
from ae.forensics.heartbeat import heartbeat_path, heartbeat_record, write_heartbeat
from ae.forensics.process_stats import RssReader, kill_descendants
from ae.forensics.progress import STUCK_AFTER_S, Progress, progress
from ae.forensics.resources import SHM, ResourceReader
from ae.forensics.stall_report import (
    collective_wait,
    describe_frame,
    dump_worker_stacks,
    main_thread_frame,
    report_body,
)
from ae.forensics.stragglers import Stragglers
from ae.log_lines import (
    DUMP_REQUEST_FILE,
    HANG_EXIT_CODE,
    HANG_TIMEOUT,
    RANK_EXIT,
    SHM_NEAR_FULL,
    STALL,
    STALL_ENDED,
    STALL_REPORT,
    STALL_RESOLVED,
)
from logging_cfg import LogPaths, RankContext

MAX_REPORT_GAP_S = 3600.0
# Phases that beat at every batch: no progress in them for STUCK_AFTER_S after a stop signal is a
# hang. (A checkpoint save, sampling or teardown may legitimately take longer.)
BEATING_PHASES = ("setup", "data loading", "training step", "validation")
# A rank blocked in a collective at --hang_timeout is most likely waiting for the rank that hangs:
# it gives that rank this long to leave first, so the verdict names the rank that hung.
HANG_VICTIM_GRACE_S = 30.0
SHM_NEAR_FULL_SHARE = 0.10  # /dev/shm with less than this share free, at a data-loading stall
SHM_FIX = (
    "dataloader workers block or die (SIGBUS) putting batches there; fix: a larger /dev/shm "
    "(docker run --shm-size=...), a smaller --batch_size, or fewer --num_workers"
)


class Watchdog(threading.Thread):
    def __init__(
        self,
        timeout: float,
        ctx: RankContext,
        heartbeat: Path | None = None,
        *,
        progress: Progress = progress,
        cuda_device: int | None = None,
        stragglers: Stragglers | None = None,
        dump_request: Path | None = None,
        hang_timeout: float = 0.0,
    ) -> None:
        super().__init__(name="ae-watchdog", daemon=True)
        self.timeout = timeout
        self.hang_timeout = hang_timeout
        self.ctx = ctx
        self.heartbeat = heartbeat
        self.progress = progress
        self.cuda_device = cuda_device
        # A stall is noticed at most `poll_s` late; the heartbeat is a few seconds old at most.
        self.poll_s = min(1.0, timeout / 4)
        self.heartbeat_s = min(5.0, max(1.0, timeout / 2))
        self.stragglers = stragglers
        if stragglers is not None:  # a short straggler window needs fresh figures
            self.heartbeat_s = min(self.heartbeat_s, max(1.0, stragglers.window_s / 5))
        self._rss = RssReader()
        # the heartbeat sits in <output_dir>/logs/: the output folder's disk is its parent's
        self._resources = ResourceReader(heartbeat.parent.parent) if heartbeat else None
        self._stop_event = threading.Event()
        self._last_heartbeat = float("-inf")
        self._stall_beat: float | None = None  # progress.last_beat when the stall began
        self._stall_where = ("", 0, 0)  # phase, epoch, step when the stall began
        self._next_report_at = timeout  # idle seconds of the next report
        self.reports = 0
        self._failed = False
        self._signal_redelivered = False
        self.dump_request = dump_request  # `ae-diagnose --dump` touches it: dump the collectives
        self._request_seen = 0

    def run(self) -> None:
        while not self._stop_event.wait(self.poll_s):
            # Native code holding the interpreter lock starves this thread: a native timer
            # dumps the stacks then (cancelled as soon as this thread runs again).
            logging_cfg.dump_stacks_later(self.timeout + 2 * self.poll_s)
            try:
                self.check()
            except Exception:
                if not self._failed:  # never kill the rank, never flood its log
                    self._failed = True
                    logger.exception("Watchdog check failed; watching goes on")
        logging_cfg.cancel_dump_stacks_later()

    def check(self) -> None:
        p = self.progress
        if line := p.stop_line():
            # In teardown the rank leaves anyway (torchrun ending the job after a peer failed):
            # INFO keeps it off rank 0's console, whose last words are the failure's own.
            logger.log("INFO" if p.stop_phase == "teardown" else "WARNING", line)
        beat, idle = p.last_beat, p.idle_s()
        if p.stop_signal is not None and idle > STUCK_AFTER_S and p.phase in BEATING_PHASES:
            self._redeliver_stop_signal(p.stop_signal)
        if self._stall_beat is not None and beat != self._stall_beat:
            self._resolved(beat - self._stall_beat)
        if idle >= self._next_report_at:
            first = self._stall_beat is None
            if first:
                self._stall_beat, self._stall_where = beat, (p.phase, p.epoch, p.step)
                # The heartbeat says `stalled` before the log does (the report body takes a
                # while): whoever has read the STALL line finds it in the heartbeat too.
                if self.heartbeat is not None:
                    self.write_heartbeat()
            self._report(idle, first)
            self._next_report_at += min(self._next_report_at, MAX_REPORT_GAP_S)
        if self.dump_request is not None:
            self._dump_if_requested(self.dump_request)
        if self.hang_timeout and idle >= self.hang_timeout:
            self._hang_exit(idle)
        due = time.monotonic() - self._last_heartbeat >= self.heartbeat_s
        if self.heartbeat is not None and due:
            if self.stragglers is not None:
                self.stragglers.check()
            self.write_heartbeat()

    def _dump_if_requested(self, request: Path) -> None:
        """One `stat` per check: a request file newer than the last one seen asks for a dump."""
        try:
            mtime = request.stat().st_mtime_ns
        except FileNotFoundError:
            return
        if mtime != self._request_seen:
            self._request_seen = mtime
            flight_recorder.dump("requested")

    def _hang_exit(self, idle: float) -> None:
        """Stalled past --hang_timeout: the final STALL report, the HANG TIMEOUT line, the exit
        line, then the process ends at once (its main thread is stuck: no `finally` can run).
        The launcher restarts the job (`--max_restarts`) or ends it with the verdict."""
        p = self.progress
        frame = main_thread_frame()
        waiting = collective_wait(frame) != "no"
        del frame
        if waiting and idle < self.hang_timeout + HANG_VICTIM_GRACE_S:
            return
        first = self._stall_beat is None
        if first:
            self._stall_beat, self._stall_where = p.last_beat, (p.phase, p.epoch, p.step)
        self._report(idle, first)
        logger.error(
            HANG_TIMEOUT.format(
                idle=f"{idle:.1f}", phase=self._stall_where[0], step=self._stall_where[2],
                timeout=f"{self.hang_timeout:g}", code=HANG_EXIT_CODE,
            )
        )  # fmt: skip
        logger.info(RANK_EXIT.format(code=HANG_EXIT_CODE, why="hang timeout"))
        if self.heartbeat is not None:
            self.write_heartbeat(state="failed")
        kill_descendants()  # no worker, nor the curl of a remote shard, outlives the rank
        os._exit(HANG_EXIT_CODE)

    def _redeliver_stop_signal(self, name: str) -> None:
        """The stop signal came while the rank was busy, and it has made no progress since: it
        will never reach the step boundary where the ranks save. Deliver the signal again to the
        main thread: the handler, seeing the rank stuck now, makes it leave through its `finally`
        blocks with its reason logged, before torchrun's SIGKILL, which leaves no trace (a main
        thread blocked in native code runs the handler when that call returns)."""
        signum = signal.Signals[name]
        if self._signal_redelivered or not callable(signal.getsignal(signum)):
            return  # once; and never to a default action, which would kill the rank outright
        self._signal_redelivered = True
        signal.pthread_kill(threading.main_thread().ident, signum)

    def write_heartbeat(self, state: str = "running") -> None:
        assert self.heartbeat is not None
        stalled = self._stall_beat is not None
        episodes = self.stragglers.episodes if self.stragglers is not None else None
        resources = self._resources.sample() if self._resources is not None else None
        record = heartbeat_record(
            self.ctx, self.progress, self._rss, stalled=stalled, state=state,
            stragglers=episodes, resources=resources,
        )  # fmt: skip
        write_heartbeat(self.heartbeat, record)
        self._last_heartbeat = time.monotonic()

    def _report(self, idle: float, first: bool) -> None:
        """A STALL report; `first`: the first of this stall."""
        self.reports += 1
        phase, epoch, step = self._stall_where
        frame = main_thread_frame()
        where, collective = describe_frame(frame), collective_wait(frame)
        del frame  # a frame reference keeps the whole stack alive
        logger.warning(
            STALL.format(
                idle=f"{idle:.1f}", phase=phase, epoch=epoch, step=step,
                report=self.reports, frame=where, collective=collective,
            )
        )  # fmt: skip
        head = STALL_REPORT.format(
            report=self.reports, rank=self.ctx.rank, pid=os.getpid(), idle=f"{idle:.1f}",
            phase=phase,
        )  # fmt: skip
        if phase == "data loading" and first:
            self._shm_check(phase)
        logger.info(f"{head}\n{report_body(where, collective, self.cuda_device)}")
        if pids := dump_worker_stacks():
            logger.info(
                f"STALL report {self.reports}: dataloader workers {pids} dumped their stacks "
                "above (faulthandler)"
            )
        if self.heartbeat is not None:
            self.write_heartbeat()
        # The collectives as they were when the rank stopped moving: last, after the report and
        # the worker stacks, which ae-diagnose reads as the report's continuation lines.
        if first:
            flight_recorder.dump("stall")

    def _shm_check(self, phase: str) -> None:
        """A data-loading stall with /dev/shm near full: say so (the stall report alone would
        show workers waiting, not why)."""
        shm = fs_space(SHM)
        if shm is not None and shm.total and shm.free < SHM_NEAR_FULL_SHARE * shm.total:
            mb = 2**20
            free, total = f"{shm.free / mb:.1f}", f"{shm.total / mb:.1f}"
            logger.warning(SHM_NEAR_FULL.format(phase=phase, free=free, total=total, fix=SHM_FIX))

    def _resolved(self, stall_s: float) -> None:
        phase, epoch, step = self._stall_where
        p = self.progress
        self._stall_beat = None
        self._next_report_at = self.timeout
        if p.phase == "teardown":  # left for teardown, not resolved: a peer died, or a stop
            why = f"stop signal {p.stop_signal}" if p.stop_signal else "a failure"
            logger.info(STALL_ENDED.format(
                idle=f"{stall_s:.1f}", phase=phase, epoch=epoch, step=step, why=why
            ))  # fmt: skip
            return
        logger.warning(
            STALL_RESOLVED.format(
                idle=f"{stall_s:.1f}", phase=phase, epoch=epoch, step=step,
                now=f"phase {p.phase}, step {p.step}",
            )
        )  # fmt: skip

    def stop(self, state: str = "exited") -> None:
        """Stop watching (a last check may log STALL RESOLVED); the heartbeat file gets its last
        `state`."""
        self._stop_event.set()
        if self.is_alive():
            self.join(timeout=10)
        if self.is_alive():  # stuck in a report: leave its state alone
            return
        self.check()
        if self.stragglers is not None:
            # A last look, due or not: the slow rank copies a line that the detecting rank wrote
            # in the last seconds of the run (a RESOLVED just before the end).
            self.stragglers.check()
        if self.heartbeat is not None:
            self.write_heartbeat(state=state)


_watchdog: Watchdog | None = None


def start_watchdog(
    stall_timeout: float,
    accelerator: str,
    ctx: RankContext,
    paths: LogPaths,
    run_ts: str,
    *,
    straggler_factor: float = 0.0,
    straggler_window: float = 60.0,
    hang_timeout: float = 0.0,
) -> None:
    """Start this rank's watchdog (nothing when `--stall_timeout=0`); with a `straggler_factor`
    it also looks for stragglers (several ranks only); with a `hang_timeout` it ends the rank
    stalled that long."""
    global _watchdog
    if stall_timeout <= 0:
        return
    cuda_device = None  # the watchdog thread's current device is cuda:0, not this rank's
    if accelerator != "cpu" and torch.cuda.is_available():
        cuda_device = ctx.local_rank % torch.cuda.device_count()
    heartbeat = heartbeat_path(paths.logs_dir, ctx.rank, run_ts)
    stragglers = None
    if straggler_factor > 0 and ctx.world_size > 1:
        # A heartbeat older than a few writes belongs to a rank that is not running steps.
        stragglers = Stragglers(
            straggler_factor, straggler_window, paths.logs_dir, run_ts, ctx,
            max_age_s=max(10.0, 3 * min(5.0, straggler_window / 5)),
        )  # fmt: skip
    _watchdog = Watchdog(
        stall_timeout, ctx, heartbeat, cuda_device=cuda_device, stragglers=stragglers,
        dump_request=paths.logs_dir / DUMP_REQUEST_FILE.format(ts=run_ts),
        hang_timeout=hang_timeout,
    )  # fmt: skip
    _watchdog.write_heartbeat()  # now, not one poll later: a rank may die in its first second
    _watchdog.start()


def stop_watchdog() -> None:
    """Call from a `finally`: the heartbeat's last state is `failed` while an exception is on
    its way out of the rank, else `exited`."""
    global _watchdog
    if _watchdog is not None:
        _watchdog.stop("failed" if sys.exc_info()[1] is not None else "exited")
        _watchdog = None
