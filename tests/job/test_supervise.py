"""The launcher's wait on its child: stop signals passed on, and what the console says."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from loguru import logger

from ae.job.supervise import GRACE_S, KILL_WAIT_S, start_child, stop_signals, wait


def ready_child(on_sigterm: str) -> subprocess.Popen:
    """A child process with `on_sigterm` (Python source) as its SIGTERM handler, once it said it
    is ready (its handler set), then sleeping a minute."""
    code = (
        "import signal, sys, time\n"
        f"signal.signal(signal.SIGTERM, {on_sigterm})\n"
        "print('ready', flush=True)\n"
        "time.sleep(60)\n"
    )
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert child.stdout is not None and child.stdout.readline() == "ready\n"
    return child


@pytest.mark.parametrize(
    ("on_stop", "line"),
    [
        (None, "SIGTERM: every rank saves a checkpoint at its next step, then stops; a rank stuck "
               "for 10 s or more leaves now, without one"),
        # ae-encode's ranks save nothing: they said they would save a checkpoint
        ("every rank stops now; the output shards it finished stay in place",
         "SIGTERM: every rank stops now; the output shards it finished stay in place"),
    ],
)  # fmt: skip
def test_a_stop_is_passed_on_and_said_as_the_job_does_it(
    on_stop: str | None, line: str, said: list[str]
) -> None:
    # A child that takes its time to stop, as torchrun does (the console speaks meanwhile)
    child = ready_child("lambda *a: (time.sleep(0.5), sys.exit(7))")
    threading.Timer(0.1, os.kill, (os.getpid(), signal.SIGTERM)).start()
    rc, stops = wait(child, on_stop=on_stop)
    assert stops.first == signal.SIGTERM and rc == 7  # passed on
    assert said == [line]


def test_a_stop_is_said_before_it_is_passed_on(tmp_path: Path) -> None:
    """A rank the launcher starts itself saves within milliseconds of its signal: passed on at
    once, the rank's own lines (its save, `PREEMPTED`) reached the console before the launcher's
    announcement of what the job does with the stop."""
    got = tmp_path / "got"
    child = ready_child(f"lambda *a: (open({str(got)!r}, 'w').close(), sys.exit(0))")
    passed_on_before: list[bool] = []
    handle = logger.add(lambda m: passed_on_before.append(got.exists()), format="{message}")
    try:
        threading.Timer(0.1, os.kill, (os.getpid(), signal.SIGTERM)).start()
        rc, stops = wait(child)
    finally:
        logger.remove(handle)
    assert (rc, stops.first) == (0, signal.SIGTERM) and got.exists()  # passed on
    assert passed_on_before == [False]  # said first


def test_the_child_starts_with_sigint_at_its_default_when_the_launcher_ignored_it(
    tmp_path: Path,
) -> None:
    """Was: a launcher started by a script in the background (`./train_ae.sh ... &`: the shell
    ignores SIGINT there) passed its ignored SIGINT on to torchrun's wrapper, which lost a
    Ctrl-C passed on in its first seconds: the console said every rank would save and stop, and
    the job trained to its end, exit 0."""
    out = tmp_path / "sigint"
    code = "import signal, sys; open(sys.argv[1], 'w').write(repr(signal.getsignal(2)))"
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        with stop_signals() as stops:
            child = start_child([sys.executable, "-c", code, str(out)], dict(os.environ), stops)
            assert child is not None and child.wait(timeout=30) == 0
    finally:
        signal.signal(signal.SIGINT, previous)
    assert "default_int_handler" in out.read_text()  # Python's own, over SIG_DFL: not SIG_IGN


def test_a_stop_before_the_child_starts_starts_none() -> None:
    """A Ctrl-C just before the child starts: recorded by the launcher's handler (it was a
    KeyboardInterrupt traceback of the launcher), and no child is started to be stopped."""
    with stop_signals() as stops:
        os.kill(os.getpid(), signal.SIGINT)
        signal.sigtimedwait([], 0.1)  # let the handler run
        assert start_child([sys.executable, "-c", "pass"], dict(os.environ), stops) is None
    assert stops.first == signal.SIGINT and stops.ctrl_c == 1 and not stops.forwarded


def test_a_stop_elsewhere_ends_a_child_that_its_sigterm_cannot_reach() -> None:
    """Was: a torchrun already in its exit barrier when its node's ranks had all stopped on
    another node's stop signal (a wait in C++, where its SIGTERM handler cannot run) kept the
    launcher waiting for its 300 s: the launcher now kills it after GRACE_S."""
    child = ready_child("signal.SIG_IGN")
    said = "Stopped on another node: rank 1 on node1 (SIGTERM) got a stop signal"
    started = time.monotonic()
    rc, stops = wait(child, stopped_elsewhere=lambda: said)
    assert stops.elsewhere == said and stops.killed and rc == -signal.SIGKILL
    assert time.monotonic() - started < GRACE_S + KILL_WAIT_S + 10
