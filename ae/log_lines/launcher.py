"""The plain lines of a run's `launcher_<TS>.log` that ae writes itself (re-exported by
`ae.log_lines`, where readers find every format), beside torchrun's own output there. Read by
ae-diagnose (`ae.diagnose.launcher_log`): how each rank process ended, and whether a stop signal
came from the launcher's death.

A rank has torchrun for a parent on several processes per node; one process on one node, and a
SLURM task's rank, are started by the launcher itself (`ae.job.launch.rank_is_child`), which then
says what torchrun's report would: how its rank ended.
"""

from __future__ import annotations

from logging_cfg.formats import LineFormat

# torchrun's launcher died (killed, its terminal closed), so the kernel sent it SIGTERM, which it
# passed on to the ranks (`ae.job.torchrun`).
LAUNCHER_GONE = LineFormat(
    "The launcher (pid {pid}) is gone: the kernel sent torchrun SIGTERM, which it passed on to "
    "the ranks",
    {"pid": "int"},
)
# The same for a rank the launcher started itself, written by the rank as it ends.
RANK_LAUNCHER_GONE = LineFormat(
    "The launcher (pid {pid}) is gone: the kernel sent rank {rank} SIGTERM",
    {"pid": "int", "rank": "int"},
)
# A rank the launcher started itself ended other than with 0 (a negative code: the signal that
# killed it), written by the launcher.
RANK_ENDED = LineFormat(
    "Rank {rank} (pid {pid}) ended with exit code {code}",
    {"rank": "int", "pid": "int", "code": "int"},
)
