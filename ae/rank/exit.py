"""How a rank process ends, the same for training and for encoding.

A user error is one message without a traceback (that of its cause, when it has one, goes to the
rank's debug log only); a write that found its filesystem full is one
`Disk full` line and exit code 28; anything else propagates to logging_cfg's FATAL hook (and
torchrun's error file). Then, always, with SIGTERM recorded rather than fatal (torchrun's, when a
peer failed, must not cut this short): the `teardown` phase, the rank's collectives dumped if it
failed or was stopped (`ae.forensics.flight_recorder`, before the process group goes), the
process group destroyed, the watchdog stopped, a note in the launcher log if the launcher that
started this rank died meanwhile, and `Rank exiting with code N`: the last line of a rank that
ends on its own, which is how ae-diagnose tells it from a killed one.
"""

from __future__ import annotations

import signal
import sys
from collections.abc import Callable

import torch.distributed as dist
from loguru import logger

import logging_cfg
from ae.atomic_files import disk_full_error, fs_space, human_size
from ae.errors import DiskFullError, UserError
from ae.forensics import flight_recorder
from ae.forensics.progress import progress
from ae.forensics.watchdog import stop_watchdog
from ae.job.rank_env import note_launcher_gone
from ae.log_lines import DISK_FULL, RANK_EXIT, main_log
from ae.training.preemption import SigtermWhileStuck, on_stop_signal


def run_to_exit(work: Callable[[], str]) -> int:
    """Run `work` (which returns how it ended, for the exit line); returns the exit code."""
    try:
        why = work()
    except UserError as e:
        # User mistakes: one clear message, no traceback (the launcher catches most earlier).
        if not logging_cfg.is_configured():
            logging_cfg.configure_console()
        logger.error(e.render())
        if e.__cause__ is not None:
            # What raised it (a user's own model, deep in its code) is detail: the rank's debug
            # log only (INFO, not `main`), with the traceback the message leaves out.
            logger.opt(exception=e.__cause__).info(f"{type(e).__name__} came from:")
        code, why = e.exit_code, type(e).__name__
    except SigtermWhileStuck as e:
        logger.warning(e.describe())  # here, not in the signal handler that raised it
        raise
    except Exception as e:
        if (full := disk_full_error(e)) is None:
            raise
        # The partial file is gone (its bytes free again): this line can still be written.
        main_log.error(disk_full_line(full))
        code, why = DiskFullError.exit_code, "disk full"
    else:
        code = 0
    finally:
        # A failed fit leaves SIGTERM at its default (Lightning's teardown restores the handler
        # it found), and torchrun SIGTERMs this rank as soon as a peer fails: killed here, the
        # rank would leave no Flight Recorder dump and no fatal record -- the evidence that
        # names the rank that failed first. The stop handler records it and goes on, leaving
        # only a teardown stuck past STUCK_AFTER_S (torchrun's SIGKILL comes after that).
        signal.signal(signal.SIGTERM, on_stop_signal)
        progress.enter("teardown")
        if (exc := sys.exc_info()[1]) is not None:
            flight_recorder.dump(f"failed: {type(exc).__name__}")
        elif progress.stop_signal is not None:
            flight_recorder.dump(f"stopped: {progress.stop_signal}")
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
        stop_watchdog()
        note_launcher_gone(logging_cfg.RankContext.from_env().rank)
    logger.info(RANK_EXIT.format(code=code, why=why))
    return code


def disk_full_line(e: OSError) -> str:
    """The one ERROR line of a write that found its filesystem full."""
    if isinstance(e, DiskFullError):
        what, free, total = e.what, e.free, e.total
    else:  # a write elsewhere (a sample grid, a cache file, a log)
        space = fs_space(e.filename) if e.filename else None
        what, free, total = "file", space and space.free, space and space.total
    fix = (
        "free space there, or use a smaller --checkpoints_total_limit or another --output_dir; "
        "the previous checkpoint is kept: resume with --resume_from_checkpoint=last"
    )
    return DISK_FULL.format(
        what=what, path=e.filename, fix=fix,
        free="?" if free is None else human_size(free),
        total="?" if total is None else human_size(total),
    )  # fmt: skip
