"""Writer: torchrun, with its own output in the run's `launcher_<TS>.log` (read by
`ae.diagnose.launcher_log`).

torchrun's agent writes its progress lines, and when a rank fails its `ChildFailedError` report,
through Python's `sys.stdout` / `sys.stderr`; the ranks it starts inherit its file descriptors 1
and 2. Pointing only the Python streams at the file moves torchrun's own words off the console
and keeps the ranks' (rank 0's summary lines); the launcher prints the diagnosis instead of the
report, which stays in the file for anyone who wants it.

    python -m ae.job.torchrun LOG_FILE [torchrun arguments ...]
"""

from __future__ import annotations

import os
import signal
import sys
import traceback

from ae.job.elastic import ELASTIC_ENV, JobEnds, install


def main(argv: list[str]) -> int:
    log_file, *args = argv
    # Until torchrun installs its handlers, Ctrl-C ends it as SIGTERM does: at once, quietly.
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    with open(log_file, "a", buffering=1, encoding="utf-8", errors="backslashreplace") as log:
        sys.stdout = sys.stderr = log
        try:
            # Imported after the streams are replaced: torch's logging handlers take the
            # stream that sys.stderr is when they are created.
            from torch.distributed.run import main as torchrun

            if (elastic := os.environ.get(ELASTIC_ENV)) is not None:
                # Its lines go to this node's console: loguru took sys.stderr at its import.
                install(elastic)

            torchrun(args)
        except JobEnds as e:
            return e.code
        except SystemExit as e:
            return e.code if isinstance(e.code, int) else 1
        except BaseException:  # ChildFailedError, SignalException: the report, in the file
            traceback.print_exc()
            return 1
        finally:
            sys.stdout, sys.stderr = sys.__stdout__, sys.__stderr__
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
