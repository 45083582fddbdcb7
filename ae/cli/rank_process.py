"""The process started for each rank: by torchrun, or by the launcher itself (one process on one
node, one SLURM task), which it then follows (`ae.job.rank_env.follow_launcher`).

Its native output -- C++ code writing to file descriptors 1 and 2: c10d, gloo, NCCL -- goes to
the rank's native log from the first line, before torch is imported: importing torch.distributed
already writes (`[c10d] The debug level is set to INFO` under --debug), and so does the TCPStore
client of the run-timestamp handshake. Then one rank's flow, `ae.rank.train`, runs.
"""

from __future__ import annotations

import os
import signal
import sys

# Run as a program (torchrun's rank), Ctrl-C ends it as SIGTERM does, from before the imports
# below: torchrun passes the launcher's SIGINT on at once, and Python's own handler printed a
# KeyboardInterrupt traceback from whichever import it interrupted (`main` sets it again for
# the callers that import this module: train_ae.py).
if __name__ == "__main__":
    signal.signal(signal.SIGINT, signal.SIG_DFL)

import logging_cfg
from ae.config import help_text, parse_config
from ae.errors import UserError
from ae.job.rank_env import follow_launcher
from ae.process_end import run_then_exit
from logging_cfg import RankContext


def main(argv: list[str]) -> int:
    # Until training starts (`ae.training.preemption` then takes over), Ctrl-C ends the rank
    # the way SIGTERM does: at once, without a KeyboardInterrupt traceback from wherever it was.
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    follow_launcher()
    if "--help" in argv or "-h" in argv:
        # Before torch and Lightning are imported: `python train_ae.py --help` answers in half a
        # second, not the ~7 s (of CPU, on 2 cores) that a rank's imports take.
        sys.stdout.write(help_text() + "\n")  # text to read, not a log line: no clock time
        return 0
    try:
        logs = parse_config(argv).run.dir.logs
    except UserError:
        logs = None  # ae.rank.train says what is wrong, once
    if logs is not None:
        ts = os.environ.get("AE_RUN_TS")
        logging_cfg.start_native_capture(logs, RankContext.from_env(), ts)
    from ae.rank.train import main as rank_main  # torch and Lightning: after the capture

    return rank_main(argv)


if __name__ == "__main__":
    run_then_exit(main, sys.argv[1:])
