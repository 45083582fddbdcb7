"""torchrun's report, read for how each rank process ended (`ae.diagnose.launcher_log`)."""

from __future__ import annotations

from pathlib import Path

from ae.diagnose.launcher_log import read_launcher_logs

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
