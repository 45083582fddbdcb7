"""logging_cfg's sinks in real processes: multi-process rotation that loses and repeats nothing
and keeps at most N files, the hot path's debug line as loguru writes it, idle third-party
warnings kept out, a closed console pipe dropped."""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap
from pathlib import Path

from tests.logging_cfg.rank_processes import run_rank
from tests.support.runs import ROOT


def test_rotation_across_processes_loses_and_repeats_nothing(tmp_path: Path) -> None:
    """A rank and its forked child append to one debug log that rotates many times."""
    proc = run_rank(
        tmp_path,
        """
        pid = os.fork()
        who = "child" if pid == 0 else "parent"
        for i in range(400):
            logger.info(f"{who} line {i:04d} " + "x" * 60)
        if pid == 0:
            os._exit(0)
        os.waitpid(pid, 0)
        """,
        rotate_mb=0.004,
        rotate_keep=200,
    )
    assert proc.returncode == 0, proc.stderr
    files = sorted(tmp_path.glob("debug_rank1_TS.log*"))
    assert len(files) > 10  # 800 lines of ~130 bytes in 4 KB files
    lines = [ln for f in files for ln in f.read_text().splitlines()]
    got = sorted(re.search(r"(child|parent) line \d+", ln)[0] for ln in lines)
    want = sorted(f"{who} line {i:04d}" for who in ("child", "parent") for i in range(400))
    assert got == want
    # Each process checks the size before its write: two may overshoot by a line each.
    assert all(f.stat().st_size <= 0.004 * 2**20 + 2 * 140 for f in files)


def test_rotation_keeps_at_most_n_files(tmp_path: Path) -> None:
    proc = run_rank(
        tmp_path,
        """
        for i in range(300):
            logger.warning(f"line {i:04d} " + "y" * 60)
        """,
        rotate_mb=0.002,
        rotate_keep=2,
    )
    assert proc.returncode == 0, proc.stderr
    for log in ("debug_rank1_TS.log", "train_TS.log"):
        names = sorted(p.name for p in tmp_path.glob(f"{log}*"))
        assert names == [log, f"{log}.1", f"{log}.2"]
        assert "line 0299" in (tmp_path / log).read_text()


def test_debug_line_is_the_line_loguru_writes(tmp_path: Path) -> None:
    proc = run_rank(
        tmp_path,
        """
        logger.debug("Training step 3, loss=0.5")
        logging_cfg.debug_line("Training step 3, loss=0.5")
        """,
        debug=True,
    )
    assert proc.returncode == 0, proc.stderr
    by_loguru, by_hot_path = (tmp_path / "debug_rank1_TS.log").read_text().splitlines()
    stamp = len("2026-11-21 22:15:38.039")
    assert (
        by_loguru[stamp:]
        == by_hot_path[stamp:]
        == " | DEBUG    | [Rank 1/2] Training step 3, loss=0.5"
    )
    assert re.fullmatch(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d{3}", by_hot_path[:stamp])
    quiet = run_rank(tmp_path / "info", 'logging_cfg.debug_line("dropped")', debug=False)
    assert quiet.returncode == 0 and (tmp_path / "info" / "debug_rank1_TS.log").read_text() == ""


def test_idle_third_party_warnings_are_kept_out_after_configure(tmp_path: Path) -> None:
    """configure() routes warnings into the logs with a catch-all filter, and after it the
    filters of IDLE_WARNINGS, so they win (Lightning's `__len__` warning once sat under the
    catch-all and reached every train log)."""
    proc = run_rank(
        tmp_path,
        """
        import warnings
        warnings.warn("Your `IterableDataset` has `__len__` defined. In combination with "
                      "multi-process data loading ...", UserWarning)
        warnings.warn("The `srun` command is available on your system but is not used. HINT",
                      UserWarning)
        warnings.warn("some other library warning", UserWarning)
        """,
    )
    assert proc.returncode == 0, proc.stderr
    train_log = (tmp_path / "train_TS.log").read_text()
    assert "some other library warning" in train_log  # warnings still reach the logs
    assert "has `__len__` defined" not in train_log and "srun" not in train_log


def test_a_closed_console_pipe_is_dropped_and_the_process_goes_on(tmp_path: Path) -> None:
    """`./train_ae.sh | head -5`: once the reader is gone, console lines are dropped (the log
    files keep them) and the process goes on and exits 0, not 120 at its final flush."""
    code = textwrap.dedent(
        f"""
        import logging_cfg
        from loguru import logger
        logging_cfg.configure_console()
        for i in range(2000):
            logger.info(f"line {{i}} " + "x" * 100)
        open({str(tmp_path / "after")!r}, "w").write("went on")
        """
    )
    proc = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, stderr=subprocess.PIPE)
    assert proc.stderr is not None
    first = proc.stderr.readline()
    proc.stderr.close()  # as `head -1` would
    assert proc.wait(timeout=60) == 0
    assert b"line 0" in first and (tmp_path / "after").read_text() == "went on"
