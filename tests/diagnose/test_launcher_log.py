"""torchrun's report, and the launcher's own lines, read for how each rank process ended
(`ae.diagnose.launcher_log`)."""

from __future__ import annotations

from pathlib import Path

from ae.diagnose.launcher_log import read_launcher_logs
from ae.log_lines import RANK_ENDED, RANK_LAUNCHER_GONE

# What torchrun wrote when rank 1 was SIGKILLed and it then stopped rank 0 (cut to its lines).
REPORT = """\
W1126 06:38:03.084000 25884 torch/distributed/elastic/multiprocessing/api.py:1028] Sending process 25912 closing signal SIGTERM
E1126 06:38:05.563000 25884 torch/distributed/elastic/multiprocessing/api.py:1002] failed (exitcode: -9) local_rank: 1 (pid: 25913) of binary: env
Failures:
[1]:
  time      : 2026-11-26_06:38:04
  host      : localhost
  rank      : 0 (local_rank: 0)
  exitcode  : 1 (pid: 25912)
  error_file: /tmp/torchelastic/error.json
------------------------------------------------------------
Root Cause (first observed failure):
[0]:
  time      : 2026-11-26_06:38:03
  host      : localhost
  rank      : 1 (local_rank: 1)
  exitcode  : -9 (pid: 25913)  (SIGKILL)
  error_file: <N/A>
  traceback : Signal 9 (SIGKILL) received by PID 25913
"""  # noqa: E501


def test_each_rank_gets_its_exit_code_or_signal(tmp_path: Path) -> None:
    path = tmp_path / "launcher_20261126_063753.log"
    path.write_text(REPORT)
    report = read_launcher_logs([path])
    killed, stopped = report.by_rank[1], report.by_rank[0]
    assert (killed.signal, killed.exit_code, killed.first, killed.pid) == (
        "SIGKILL",
        None,
        True,
        25913,
    )
    assert killed.describe == "killed (SIGKILL)" and killed.evidence.line == 16
    assert (stopped.signal, stopped.exit_code, stopped.first) == (None, 1, False)
    assert stopped.describe == "exited 1"
    assert report.by_pid[25913] == killed and report.by_pid[25912] == stopped
    assert read_launcher_logs([tmp_path / "none.log"]).by_pid == {}


def test_the_launchers_own_lines_for_a_rank_it_started_itself(tmp_path: Path) -> None:
    """One process on one node (or SLURM tasks, sharing the file): no torchrun, so the launcher
    says how each of its ranks ended, and a rank whose launcher died says so."""
    path = tmp_path / "launcher_20261128_170000.log"
    path.write_text(
        RANK_LAUNCHER_GONE.format(pid=4100, rank=0) + "\n"
        + RANK_ENDED.format(rank=0, pid=4242, code=-9) + "\n"
        + RANK_ENDED.format(rank=1, pid=4243, code=124) + "\n"
    )  # fmt: skip
    report = read_launcher_logs([path])
    killed, hung = report.by_rank[0], report.by_rank[1]
    assert (killed.signal, killed.pid, killed.first) == ("SIGKILL", 4242, True)
    assert killed.describe == "killed (SIGKILL)" and killed.evidence.line == 2
    assert (hung.exit_code, hung.first) == (124, False)  # not the first to end
    assert report.by_pid == {4242: killed, 4243: hung}
    assert report.stopped is not None and report.stopped.signal == "SIGTERM"
    assert report.stopped.launcher_gone == 4100 and report.stopped.evidence.line == 1
