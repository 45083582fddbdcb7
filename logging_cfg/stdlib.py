"""Stdlib logging (Lightning, torch) and `warnings` routed into loguru's sinks."""

from __future__ import annotations

import logging
import warnings

from loguru import logger

FORK_WITH_THREADS_WARNING = r"This process \(pid=\d+\) is multi-threaded, use of fork\(\)"
# Third-party warnings that say nothing true about an ae rank, kept out of every log (a user
# greps WARNING for what needs them):
IDLE_WARNINGS = (
    # Lightning: an IterableDataset with __len__ may be inaccurate with several workers unless
    # each is configured on its own; ae's are (the shard plan gives each worker its slot).
    r".*`IterableDataset` has `__len__` defined",
    # Lightning, on a machine with SLURM installed, outside a SLURM step: its advice (start each
    # rank under srun) is not how ae runs there (one launcher a node, torchrun starts the ranks).
    r"The `srun` command is available on your system but is not used",
    # Lightning 2.6 on torch >= 2.10: its own pytree helper calls a torch API now deprecated.
    r"`isinstance\(treespec, LeafSpec\)` is deprecated",
    # Lightning, for epochs shorter than its logging interval: ae sets the interval for the
    # run's length when training starts (`ae.training.metrics.log_cadence`), after this warning,
    # and the count runs on across epochs; its advice names a Trainer argument a user cannot set.
    r"The number of training batches \(\d+\) is smaller than the logging interval",
)


class _InterceptHandler(logging.Handler):
    """Send stdlib records (Lightning, torch, py.warnings) to loguru, keeping level and caller."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            level: str | int = logger.level(record.levelname).name
        except ValueError:
            level = record.levelno
        frame, depth = logging.currentframe(), 2
        while frame and frame.f_code.co_filename == logging.__file__:
            frame, depth = frame.f_back, depth + 1
        logger.opt(depth=depth, exception=record.exc_info).log(level, record.getMessage())


def route_stdlib() -> None:
    """Every stdlib record and warning into loguru (the sinks `configure` installed)."""
    logging.root.handlers = [_InterceptHandler()]
    logging.root.setLevel(logging.INFO)
    for name in (
        "lightning",
        "lightning.pytorch",
        "lightning.fabric",
        "pytorch_lightning",
        "torch",
    ):
        lg = logging.getLogger(name)
        lg.handlers.clear()
        lg.propagate = True
    logging.captureWarnings(True)
    warnings.simplefilter("default")
    # Python >= 3.12 warns from inside os.fork() when other threads run (the watchdog does, and
    # every DataLoader forks its workers). It warns in the parent before the at-fork "after"
    # hooks run, while loguru's own at-fork hook still holds every handler's lock: routed to
    # loguru, that warning deadlocks the rank at its first batch (seen on a GPU node).
    warnings.filterwarnings(
        "ignore", message=FORK_WITH_THREADS_WARNING, category=DeprecationWarning
    )
    for message in IDLE_WARNINGS:
        warnings.filterwarnings("ignore", message=message)
