"""The one place that configures logging for a training process.

`configure()` installs, for this rank:
- `debug_rank<N>_<TS>.log`: every record of this rank and its dataloader workers;
- `native_rank<N>_<TS>.log` (with `native_output=True`): what native code writes to stdout/stderr;
- `train_<TS>.log` (shared by all ranks): summary lines of rank 0 (records bound with
  `main=True`) and every WARNING/ERROR of any rank;
- a rich console on rank 0 for summary lines and problems;
- stdlib logging (Lightning, torch) and `warnings` routed into the same sinks;
- faulthandler (fatal signals, and `kill -USR1 <pid>` for an on-demand stack dump) on the debug log;
- hooks that log uncaught exceptions (main thread and other threads) as FATAL with traceback;
  `log_worker_exceptions` does the same inside dataloader workers;
- `debug_line`: the per-batch DEBUG lines, straight into the debug log (see hot_path).
Library code in `ae/` only uses `loguru.logger`; it never adds sinks.

Modules: `install` (`configure`, `configure_console`), `stdlib` (stdlib logging and warnings
into loguru), `crash` (exception hooks, faulthandler), `sinks` (the file and console sinks),
`hot_path` (`debug_line`), `native` (descriptors 1 and 2 into the native log), `rank_context`
(who is logging), `formats` (line and file-name formats, shared with the reader). This file only
re-exports the public API.
"""

from __future__ import annotations

from logging_cfg.crash import cancel_dump_stacks_later, dump_stacks_later, log_worker_exceptions
from logging_cfg.hot_path import debug_line
from logging_cfg.install import (
    LogPaths,
    configure,
    configure_console,
    is_configured,
    start_native_capture,
)
from logging_cfg.native import streams_to_native_in_child
from logging_cfg.rank_context import RankContext, resolve_run_ts

__all__ = [
    "LogPaths",
    "RankContext",
    "cancel_dump_stacks_later",
    "configure",
    "configure_console",
    "debug_line",
    "dump_stacks_later",
    "is_configured",
    "log_worker_exceptions",
    "resolve_run_ts",
    "start_native_capture",
    "streams_to_native_in_child",
]
