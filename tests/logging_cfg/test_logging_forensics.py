"""Crash forensics of logging_cfg in real processes: SIGKILL durability, FATAL hooks (main thread,
threads, dataloader workers), a worker outliving its rank, SIGUSR1 and SIGSEGV stack dumps, the
stacks of a starved watchdog, fork with threads on Python 3.12."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import textwrap
from pathlib import Path

import pytest

from tests.logging_cfg.rank_processes import PREAMBLE, run_rank
from tests.support.runs import ROOT


def test_line_logged_right_before_sigkill_is_in_the_file(tmp_path: Path) -> None:
    proc = run_rank(
        tmp_path,
        """
        logger.info("rss=812MB workers=2x120MB: last words")
        os.kill(os.getpid(), signal.SIGKILL)
        """,
    )
    assert proc.returncode == -signal.SIGKILL
    lines = (tmp_path / "debug_rank1_TS.log").read_text().splitlines()
    assert lines[-1].endswith("[Rank 1/2] rss=812MB workers=2x120MB: last words")


def test_uncaught_exceptions_are_fatal_in_both_logs(tmp_path: Path) -> None:
    proc = run_rank(
        tmp_path,
        """
        def worker_body():
            raise KeyError("in a thread")
        t = threading.Thread(target=worker_body, name="helper")
        t.start(); t.join()
        def deep():
            raise ValueError("boom in main")
        deep()
        """,
    )
    assert proc.returncode == 1
    for name in ("debug_rank1_TS.log", "train_TS.log"):
        text = (tmp_path / name).read_text()
        assert text.count("FATAL uncaught exception") == 2, text
        assert "CRITICAL | [Rank 1/2] FATAL uncaught exception KeyError in thread helper:" in text
        assert "FATAL uncaught exception ValueError in main thread: boom in main" in text
        assert re.search(r"Traceback[^|]*line \d+, in deep", text, re.S)


def test_a_process_whose_rank_is_gone_leaves_quietly(tmp_path: Path) -> None:
    """A forked child (a dataloader worker) outlives its rank (SIGKILLed) and then fails on a
    socket to it: one INFO line says so, no FATAL (issue: the worker's ConnectionResetError was
    taken for the dead rank's cause)."""
    proc = run_rank(
        tmp_path,
        """
        rank_pid = os.getpid()
        if os.fork() == 0:
            while os.getppid() == rank_pid:  # until the rank is gone
                time.sleep(0.01)
            def in_thread():
                raise BrokenPipeError(32, "Broken pipe")
            t = threading.Thread(target=in_thread, name="pin")
            t.start(); t.join()
            raise ConnectionResetError(104, "Connection reset by peer")
        os.kill(rank_pid, signal.SIGKILL)
        """,
    )
    assert proc.returncode == -signal.SIGKILL
    text = (tmp_path / "debug_rank1_TS.log").read_text()
    assert "FATAL" not in text and "Traceback" not in text, text
    assert text.count("INFO     | [Rank 1/2] parent rank gone, worker exiting") == 1, text


def test_sigusr1_dumps_all_stacks_into_the_debug_log(tmp_path: Path) -> None:
    proc = run_rank(
        tmp_path,
        """
        def waiting_here(ev):
            ev.wait()
        ev = threading.Event()
        t = threading.Thread(target=waiting_here, args=(ev,)); t.start()
        time.sleep(0.2)
        os.kill(os.getpid(), signal.SIGUSR1)
        time.sleep(0.2)
        ev.set(); t.join()
        logger.info("still running")
        """,
    )
    assert proc.returncode == 0, proc.stderr
    text = (tmp_path / "debug_rank1_TS.log").read_text()
    assert "in waiting_here" in text and "Current thread" in text
    assert text.rstrip().endswith("still running")


def test_segv_leaves_a_stack_in_the_debug_log(tmp_path: Path) -> None:
    proc = run_rank(
        tmp_path,
        """
        def crashing_here():
            os.kill(os.getpid(), signal.SIGSEGV)
        crashing_here()
        """,
    )
    assert proc.returncode == -signal.SIGSEGV
    text = (tmp_path / "debug_rank1_TS.log").read_text()
    assert "Fatal Python error: Segmentation fault" in text and "in crashing_here" in text


def test_dataloader_worker_exception_logged_from_the_worker(tmp_path: Path, make_shards) -> None:
    spec = make_shards([24])
    proc = run_rank(
        tmp_path,
        f"""
        import torch
        from ae.data.stream.shard_stream import ShardStream
        from ae.data.decoding.decode import SampleDecoder
        from ae.data.shards.spec import resolve_shards
        urls, _ = resolve_shards({spec!r}, {spec!r})
        decoder = SampleDecoder((("npy", None),), "vector", (16,))
        stream = ShardStream("train", urls, [24], decoder, batch_size=4,
                             rank=1, world_size=2, num_workers=1)
        for batch in torch.utils.data.DataLoader(stream, batch_size=None, num_workers=1):
            pass
        """,
        env={"AE_FAULT": "raise@data:step=1", "RANK": "1"},
    )
    assert proc.returncode == 1
    text = (tmp_path / "debug_rank1_TS.log").read_text()
    worker = "[Rank 1/2 Worker 0/1] FATAL uncaught exception InjectedFault in dataloader worker 0/1"
    assert worker in text
    # the worker's own traceback, then the rank's FATAL for the re-raised exception
    assert re.search(r"Worker 0/1\] FATAL.*\nTraceback.*in _injected_raise", text, re.S)
    assert "[Rank 1/2] FATAL uncaught exception InjectedFault in main thread" in text
    assert text.index("dataloader worker 0/1:") < text.index("in main thread:")


def test_stacks_dumped_when_the_watchdog_itself_is_starved(tmp_path: Path) -> None:
    """Native code holding the interpreter lock: the watchdog thread cannot run, the native
    timer it keeps re-arming fires and faulthandler dumps the stacks."""
    proc = run_rank(
        tmp_path,
        """
        from ae.forensics.watchdog import Watchdog
        dog = Watchdog(1.0, ctx)
        dog.start()
        time.sleep(0.6)
        t0 = time.perf_counter()
        sum(range(10**6))
        n = int(10**6 * 3.0 / (time.perf_counter() - t0))
        def holding_the_gil():
            sum(range(n))  # one C loop of ~3 s: no bytecode, so no GIL hand-over
        holding_the_gil()
        dog.stop()
        """,
    )
    assert proc.returncode == 0, proc.stderr
    text = (tmp_path / "debug_rank1_TS.log").read_text()
    assert "Timeout (0:00:01.500000)!" in text and "in holding_the_gil" in text


def _python312() -> str | None:
    """A working Python 3.12 interpreter (pyenv's shim answers even when 3.12 is not selected)."""
    candidates = [*sorted(Path.home().glob(".pyenv/versions/3.12*/bin/python3.12"))]
    candidates += [Path(w) for w in [shutil.which("python3.12")] if w]
    for exe in candidates:
        ok = subprocess.run([exe, "-c", "pass"], capture_output=True, timeout=30).returncode == 0
        if ok:
            return str(exe)
    return None


PYTHON312 = _python312()


@pytest.mark.skipif(PYTHON312 is None, reason="no python3.12 on this machine")
def test_fork_with_threads_does_not_deadlock_on_python_312(tmp_path: Path) -> None:
    """Python 3.12 warns inside os.fork() when other threads run, while loguru's at-fork hook
    holds its handler locks; routed to loguru, that warning hung every rank at its first
    DataLoader fork (seen on a GPU node). Run in a real 3.12 interpreter: logging_cfg needs only
    the standard library and loguru (pure Python, taken from this venv)."""
    import loguru

    body = """
        threading.Thread(target=time.sleep, args=(30,), daemon=True).start()
        pid = os.fork()
        if pid == 0:
            os._exit(0)
        os.waitpid(pid, 0)
        logger.info("parent carries on after the fork")
        warnings.warn("an ordinary deprecation", DeprecationWarning)
        """
    code = PREAMBLE.format(rank=1, logs=str(tmp_path), kwargs={}) + "import warnings\n"
    code += textwrap.dedent(body)
    site = str(Path(loguru.__file__).parent.parent)
    proc = subprocess.run(
        [PYTHON312, "-c", code],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{site}"},
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    text = (tmp_path / "debug_rank1_TS.log").read_text()
    assert "parent carries on after the fork" in text
    assert "an ordinary deprecation" in text  # other warnings still reach the logs
    assert "is multi-threaded, use of fork()" not in text
