"""What the launcher tells its ranks through the environment: the names it sets, read by
`ae.rank.train`. Apart from the launcher's modules on purpose: a rank imports this, not the
launcher (which brings ae-diagnose and the restart rules along: ~0.3 s of CPU in every rank).
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

from ae.log_lines import RANK_LAUNCHER_GONE, RESTART
from ae.process_end import die_with_parent

# Set for the processes the launcher starts: it reports their failures itself, once they end.
LAUNCHER_ENV = "AE_LAUNCHER"
# The RESTART line, for rank 0 of the new attempt to write first into its train log.
RESTART_ENV = "AE_RESTART"
# A resumed run's line on the steps it trains again (`ae.job.restarts.resume_note`), for rank 0's
# train log.
RESUME_NOTE_ENV = "AE_RESUME_NOTE"
# Set for a rank that the launcher starts itself, with no torchrun between them (one process on
# one node; a SLURM task's rank): the launcher's pid, which the rank follows as torchrun's wrapper
# does (`ae.job.torchrun`), and the attempt's launcher log, where it notes that death.
LAUNCHER_PID_ENV = "AE_LAUNCHER_PID"
LAUNCHER_LOG_ENV = "AE_LAUNCHER_LOG"
AS_THE_FIRST_ATTEMPT = "as the first attempt did"  # a RESTART's checkpoint when there is none


def restart_checkpoint(line: str | None) -> str | None:
    """The checkpoint a RESTART line says the attempt resumes from; None for no restart, or one
    that starts as the first attempt did (no checkpoint then)."""
    m = RESTART.parse(line) if line else None
    return m["checkpoint"] if m and m["checkpoint"] != AS_THE_FIRST_ATTEMPT else None


def follow_launcher() -> None:
    """SIGTERM to this rank when the launcher that started it dies, however it dies (killed, its
    terminal closed): the rank then saves at its next step and stops, as after a `kill -TERM` of
    the launcher. Nothing for a rank under torchrun, whose wrapper follows the launcher."""
    if (pid := os.environ.get(LAUNCHER_PID_ENV)) is not None:
        die_with_parent(signal.SIGTERM, int(pid))


def note_launcher_gone(rank: int) -> None:
    """At the rank's end: where the launcher that started it died meanwhile (this process was
    reparented), say so in the attempt's launcher log, as torchrun's wrapper does for its ranks
    (`ae.diagnose.launcher_log` reads it: the job's SIGTERM came from that death)."""
    pid, log = os.environ.get(LAUNCHER_PID_ENV), os.environ.get(LAUNCHER_LOG_ENV)
    if pid is None or log is None or os.getppid() == int(pid):
        return
    try:
        with Path(log).open("a", encoding="utf-8") as f:
            f.write(RANK_LAUNCHER_GONE.format(pid=pid, rank=rank) + "\n")
    except OSError:
        pass  # a note for ae-diagnose: the rank's own logs say the stop already
