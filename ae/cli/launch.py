"""`./train_ae.sh` and `ae-train`: the flags -> `ae.job.launch` (which checks them, claims the
run folder and starts torchrun over `ae.cli.rank_process`, one process per rank)."""

from __future__ import annotations

import sys

import logging_cfg
from ae.config import help_text
from ae.job.launch import launch


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "--help" in argv or "-h" in argv:
        # Text to read, not a log line: no clock time in front of it.
        sys.stdout.write(help_text() + "\n")
        return 0
    logging_cfg.configure_console()
    return launch(argv)


if __name__ == "__main__":
    sys.exit(main())
