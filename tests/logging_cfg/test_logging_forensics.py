"""Crash forensics of logging_cfg in real processes: SIGKILL durability, FATAL hooks (main thread,
threads, dataloader workers), SIGUSR1 stack dumps, multi-process rotation, native output."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.support.runs import ROOT

PREAMBLE = """
import os, signal, sys, threading, time
from pathlib import Path
import logging_cfg
from loguru import logger
ctx = logging_cfg.RankContext(rank={rank}, world_size=2)
paths = logging_cfg.configure(Path({logs!r}), "TS", ctx, **{kwargs!r})
"""


def run_rank(
    logs: Path, body: str, rank: int = 1, env: dict[str, str] | None = None, **kwargs: object
) -> subprocess.CompletedProcess:
    code = PREAMBLE.format(rank=rank, logs=str(logs), kwargs=kwargs) + textwrap.dedent(body)
    return subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        env={**os.environ, **(env or {})},
        capture_output=True,
        text=True,
        timeout=120,
    )


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


def test_native_output_goes_to_the_rank_file(tmp_path: Path) -> None:
    body = """
    print("python-level print")
    os.write(1, b"native stdout\\n")
    os.write(2, b"native stderr\\n")
    """
    rank1 = run_rank(tmp_path, body, rank=1, native_output=True)
    rank0 = run_rank(tmp_path, body, rank=0, native_output=True)
    assert rank1.returncode == rank0.returncode == 0
    # Rank 1: everything, Python-level output included, is in its native file.
    assert rank1.stdout == rank1.stderr == ""
    native1 = (tmp_path / "native_rank1_TS.log").read_text()
    assert native1 == "python-level print\nnative stdout\nnative stderr\n"
    # Rank 0: Python-level output keeps the console; native writes go to the file.
    assert rank0.stdout == "python-level print\n"
    assert (tmp_path / "native_rank0_TS.log").read_text() == "native stdout\nnative stderr\n"


def test_a_console_ranks_dataloader_worker_writes_python_output_to_the_native_file(
    tmp_path: Path,
) -> None:
    """Rank 0 keeps the console for Python-level output; its dataloader workers (forked, through
    the loader's worker_init_fn) do not: a traceback that multiprocessing's queue thread prints
    in a worker (shared memory full) belongs in the native log."""
    body = """
    import torch
    from ae.data.stream.loader import PreemptibleLoader

    class Talks(torch.utils.data.IterableDataset):
        def __iter__(self):
            print("printed in a worker", file=sys.stderr)
            yield torch.zeros(1)

    print("printed in the rank")
    assert len(list(PreemptibleLoader(Talks(), num_workers=1, batch_size=None))) == 1
    """
    rank0 = run_rank(tmp_path, body, rank=0, native_output=True)
    assert rank0.returncode == 0, rank0.stderr
    assert rank0.stdout == "printed in the rank\n"
    assert "printed in a worker" not in rank0.stderr
    assert "printed in a worker\n" in (tmp_path / "native_rank0_TS.log").read_text()


EARLY = """
import os, sys
from pathlib import Path
import logging_cfg
ctx = logging_cfg.RankContext(rank={rank}, world_size=2)
logging_cfg.start_native_capture(Path({logs!r}), ctx, {ts!r})
os.write(2, b"[I1123 09:47:17.6 debug.cpp:48] [c10d] before the run TS is known\\n")
print("python-level before", flush=True)
logging_cfg.configure(Path({logs!r}), "TS", ctx, native_output=True)
os.write(2, b"native after configure\\n")
print("python-level after")
"""


def test_native_output_is_captured_from_the_first_line(tmp_path: Path) -> None:
    """A rank captures before anything else; without the run's TS yet into a pending file, which
    `configure` renames (or appends to the run's file when that exists)."""
    for rank, ts in ((1, None), (0, "TS")):
        code = EARLY.format(rank=rank, logs=str(tmp_path), ts=ts)
        proc = subprocess.run(
            [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60
        )
        assert proc.returncode == 0, proc.stderr
        assert "[I1123" not in proc.stderr + proc.stdout
    native1 = (tmp_path / "native_rank1_TS.log").read_text()
    assert native1.startswith("[I1123 09:47:17.6 debug.cpp:48] [c10d] before the run TS")
    assert "python-level before\nnative after configure\npython-level after\n" in native1
    native0 = (tmp_path / "native_rank0_TS.log").read_text()  # rank 0 keeps its console
    assert native0.endswith("is known\nnative after configure\n")
    assert not list(tmp_path.glob(".native*"))  # the pending file became the rank's file
    # a second process of rank 1 in the same run (a restart): appended, nothing lost
    code = EARLY.format(rank=1, logs=str(tmp_path), ts=None)
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True, timeout=60)
    text = (tmp_path / "native_rank1_TS.log").read_text()
    assert text.startswith(native1) and text.count("before the run TS") == 2
    assert not list(tmp_path.glob(".native*"))


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
