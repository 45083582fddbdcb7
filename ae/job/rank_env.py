"""What the launcher tells its ranks through the environment: the names it sets, read by
`ae.rank.train`. Apart from the launcher's modules on purpose: a rank imports this, not the
launcher (which brings ae-diagnose and the restart rules along: ~0.3 s of CPU in every rank).
"""

from __future__ import annotations

from ae.log_lines import RESTART

# Set for the processes the launcher starts: it reports their failures itself, once they end.
LAUNCHER_ENV = "AE_LAUNCHER"
# The RESTART line, for rank 0 of the new attempt to write first into its train log.
RESTART_ENV = "AE_RESTART"
# A resumed run's line on the steps it trains again (`ae.job.restarts.resume_note`), for rank 0's
# train log.
RESUME_NOTE_ENV = "AE_RESUME_NOTE"
AS_THE_FIRST_ATTEMPT = "as the first attempt did"  # a RESTART's checkpoint when there is none


def restart_checkpoint(line: str | None) -> str | None:
    """The checkpoint a RESTART line says the attempt resumes from; None for no restart, or one
    that starts as the first attempt did (no checkpoint then)."""
    m = RESTART.parse(line) if line else None
    return m["checkpoint"] if m and m["checkpoint"] != AS_THE_FIRST_ATTEMPT else None
