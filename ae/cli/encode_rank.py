"""The process started for each rank of ae-encode (by torchrun, or by the launcher itself for one
process on one node): one rank's flow, `ae.rank.encode`.

As for a training rank (`ae.cli.rank_process`): Ctrl-C ends it at once, as SIGTERM does (torchrun
passes the launcher's SIGINT on to its ranks), not with a KeyboardInterrupt traceback from the
middle of its imports on the console; and its native output goes to its native log from the
first line, before torch is imported.
"""

from __future__ import annotations

import os
import signal
import sys

# Run as a program (torchrun's rank), Ctrl-C ends it as SIGTERM does, from before the imports
# below: torchrun passes the launcher's SIGINT on at once, and Python's own handler printed a
# KeyboardInterrupt traceback from whichever import it interrupted (`main` sets it again for a
# caller that imports this module).
if __name__ == "__main__":
    signal.signal(signal.SIGINT, signal.SIG_DFL)

import logging_cfg
from ae.errors import UserError
from ae.job.encode_args import parse_args
from ae.job.rank_env import follow_launcher
from ae.process_end import run_then_exit
from logging_cfg import RankContext


def main(argv: list[str]) -> int:
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    follow_launcher()  # the launcher's own child (one process): it stops when the launcher dies
    try:
        logs = parse_args(argv).logs
    except UserError:
        logs = None  # ae.rank.encode says what is wrong, once
    if logs is not None:
        logging_cfg.start_native_capture(logs, RankContext.from_env(), os.environ.get("AE_RUN_TS"))
    from ae.rank.encode import main as rank_main  # torch and Lightning: after the capture

    return rank_main(argv)


if __name__ == "__main__":
    run_then_exit(main, sys.argv[1:])
