"""ae.process_end: what Python's exit promises is kept (threads joined, atexit handlers run,
buffered output flushed, the exit code), and only the interpreter's teardown is skipped."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.support.runs import ROOT

SCRIPT = """
import atexit, sys, threading, time
from pathlib import Path
from ae.process_end import exit_without_teardown, run_then_exit

out = Path(sys.argv[1])

class TornDown:
    def __init__(self, path):
        self.path, self.open = path, open  # what __del__ needs, kept while modules are cleared

    def __del__(self):
        self.open(self.path, "w").close()

kept = TornDown(str(out / "torn_down"))  # a module global: only the teardown deletes it

def late_writer():
    time.sleep(0.3)
    (out / "thread").write_text("")

threading.Thread(target=late_writer).start()  # not a daemon: exit waits for it
atexit.register(lambda: (out / "atexit").write_text(""))
sys.excepthook = lambda t, e, tb: (out / "reported").write_text(repr(e))
sys.stdout.write("buffered, no newline")  # a pipe: block-buffered until flushed
{end}
"""


def _run(tmp_path: Path, end: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", SCRIPT.format(end=end), str(tmp_path)],
        cwd=ROOT, capture_output=True, text=True, timeout=60,
    )  # fmt: skip


def test_keeps_threads_atexit_output_and_code_and_skips_the_teardown(tmp_path: Path) -> None:
    proc = _run(tmp_path, "exit_without_teardown(3)")
    assert proc.returncode == 3, proc.stderr
    assert proc.stdout == "buffered, no newline"
    assert (tmp_path / "thread").exists()
    assert (tmp_path / "atexit").exists()
    assert not (tmp_path / "torn_down").exists()


def test_the_script_sees_a_teardown_where_python_exits_its_own_way(tmp_path: Path) -> None:
    """The control: the same script ended by sys.exit tears its globals down, so the check of
    the skipped teardown above can fail."""
    proc = _run(tmp_path, "sys.exit(3)")
    assert proc.returncode == 3, proc.stderr
    assert (tmp_path / "torn_down").exists()


def test_an_exception_is_reported_by_the_excepthook_and_exits_1_without_teardown(
    tmp_path: Path,
) -> None:
    proc = _run(tmp_path, "run_then_exit(lambda argv: 1 / 0, [])")
    assert proc.returncode == 1, proc.stderr
    assert (tmp_path / "reported").read_text() == "ZeroDivisionError('division by zero')"
    assert (tmp_path / "thread").exists() and (tmp_path / "atexit").exists()
    assert not (tmp_path / "torn_down").exists()
    assert _run(tmp_path, "run_then_exit(lambda argv: sys.exit(4), [])").returncode == 4
    assert _run(tmp_path, "run_then_exit(lambda argv: 5, [])").returncode == 5
