"""Writer: torchrun, with its own output in the run's `launcher_<TS>.log` (read by
`ae.diagnose.launcher_log`).

torchrun's agent writes its progress lines, and when a rank fails its `ChildFailedError` report,
through Python's `sys.stdout` / `sys.stderr`; the ranks it starts inherit its file descriptors 1
and 2. Pointing only the Python streams at the file moves torchrun's own words off the console
and keeps the ranks' (rank 0's summary lines); the launcher prints the diagnosis instead of the
report, which stays in the file for anyone who wants it.

It dies with the launcher (`follow_launcher`): the launcher runs it in a session of its own (so
that Ctrl-C reaches the launcher alone), where a SIGKILL of the launcher's process group, or the
SIGHUP of a closed terminal, would not reach it. The kernel sends it SIGTERM when the launcher
dies, however it dies; torchrun passes it on to the ranks, which save a checkpoint at their next
step and stop (`ae.training.preemption`), as after a `kill -TERM` of the launcher. It inherits
the launcher's `run.lock` descriptor (`ae.job.folder_lock`), so the folder stays locked until it
and its ranks are gone.

    python -m ae.job.torchrun LOG_FILE LAUNCHER_PID [torchrun arguments ...]
"""

from __future__ import annotations

import os
import signal
import sys
import traceback
from types import FrameType

# Until torchrun installs its handlers, Ctrl-C ends this process as SIGTERM does: at once,
# quietly. First, before the imports below (a second or two): the launcher passes a Ctrl-C on
# as soon as this process exists, and Python's own handler printed a KeyboardInterrupt
# traceback from whichever import it interrupted onto the user's console.
if __name__ == "__main__":
    signal.signal(signal.SIGINT, signal.SIG_DFL)

import logging_cfg
from ae.job.elastic import ELASTIC_ENV, JobEnds, install
from ae.log_lines import LAUNCHER_GONE
from ae.process_end import die_with_parent, run_then_exit


def follow_launcher(launcher_pid: int) -> None:
    """SIGTERM to this process when its parent, the launcher, dies (or now, if it is gone)."""
    die_with_parent(signal.SIGTERM, launcher_pid)


def once_per_stop() -> None:
    """torchrun's agent turns a stop signal into an exception, then stops the ranks (SIGTERM,
    and up to 30 s for them to save). A second signal in that time raised again inside that
    shutdown, and torchrun died with its ranks unsaved: under SLURM, `scancel` and `scontrol
    requeue` signal every process of the step, torchrun too, besides the launcher's SIGTERM
    passed on (seen: a requeue during setup, `rank 0 killed without trace`). After the first,
    the others are ignored; the launcher's second Ctrl-C and SLURM's SIGKILL still end it."""
    from torch.distributed.elastic.multiprocessing import api

    first = api._terminate_process_handler

    def handler(signum: int, frame: FrameType | None) -> None:
        for name in ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT"):
            signal.signal(getattr(signal, name), signal.SIG_IGN)
        first(signum, frame)

    api._terminate_process_handler = handler  # looked up when the agent registers it


def main(argv: list[str]) -> int:
    log_file, launcher_pid, *args = argv
    follow_launcher(int(launcher_pid))
    with open(log_file, "a", buffering=1, encoding="utf-8", errors="backslashreplace") as log:
        sys.stdout = sys.stderr = log
        try:
            # Imported after the streams are replaced: torch's logging handlers take the
            # stream that sys.stderr is when they are created.
            from torch.distributed.run import main as torchrun

            once_per_stop()

            if (elastic := os.environ.get(ELASTIC_ENV)) is not None:
                # Its lines (RESTART, the job's end) go to this node's console, as the
                # launcher's own do: `12:00:01 message`.
                logging_cfg.configure_console(stream=sys.__stderr__)
                install(elastic)

            torchrun(args)
        except JobEnds as e:
            return e.code
        except SystemExit as e:
            return e.code if isinstance(e.code, int) else 1
        except BaseException:  # ChildFailedError, SignalException: the report, in the file
            traceback.print_exc()
            if os.getppid() != int(launcher_pid):  # reparented: the launcher died
                log.write(LAUNCHER_GONE.format(pid=launcher_pid) + "\n")  # the file, line-buffered
            return 1
        finally:
            sys.stdout, sys.stderr = sys.__stdout__, sys.__stderr__
    return 0


if __name__ == "__main__":
    run_then_exit(main, sys.argv[1:])
