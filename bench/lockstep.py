"""Sides of a benchmark that run in turns: every side's processes are started at once, and each
side runs a slice of its timed window while the others wait, blocked on a socket read.

Why: on a shared VM the machine's speed drifts over seconds (this 2-vCPU VM's rounds of the same
side, one after the other, swung up to 2x). Sides measured one after another then compare two
machines; sides that take turns every fraction of a second see the same drift, so their ratio
holds still. A waiting process uses no CPU, and its clock counts only its own slices.

The coordinator (`run_in_turns`, in the bench's main process) listens on a Unix socket named in
each side's environment (`ENV`). A process of a side (`Turns`, in the measured process) says
hello with its side's name, then, at the end of each slice, `ready` (or `done` after its last
one) and waits for `go`. Every side first runs its warm-up to its first `ready`, so that no
side's start-up (imports, setup) overlaps another's slice; after every side is `done`, all are
let go together, so that no side's teardown overlaps another's slice either.

A side's command is an argv (a new interpreter: what a measurement wants) or a function to run
in a process forked from the coordinator's (`Forked`: a smoke run's way to spare every process
the seconds of importing torch and Lightning that the coordinator has paid once).
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import IO

# A side's command: an argv, or a function run in a forked process (its return: the exit code)
Command = list[str] | Callable[[], int]

ENV = "AE_BENCH_TURNS"  # the coordinator's socket, in the environment of every measured process


class Turns:
    """A measured process's end: `wait()` between its slices. Without the coordinator (a side run
    alone) it never waits."""

    def __init__(self, side: str) -> None:
        self.sock: socket.socket | None = None
        if path := os.environ.get(ENV):
            self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            self.sock.connect(path)
            self.sock.sendall(f"{side}\n".encode())
            self.reader = self.sock.makefile("r")

    def wait(self, last: bool = False) -> None:
        """This process's slice is over (`last`: its timed window too); returns at its next turn
        (after `last`: once every side is done)."""
        if self.sock is None:
            return
        self.sock.sendall(b"done\n" if last else b"ready\n")
        if self.reader.readline().strip() != "go":
            raise RuntimeError("the lockstep coordinator went away")


class Forked:
    """`fn()` in a child forked from this process, with `env` as its environment, stdout to
    /dev/null and stderr to `stderr`; the exit code is what `fn` returns (1 if it raises, the
    traceback on stderr). What `run_in_turns` uses of `subprocess.Popen`: poll, wait, kill,
    returncode. The child leaves by `os._exit`: none of the parent's cleanup (its temporary
    folders, its open sockets' owners) runs twice."""

    def __init__(self, fn: Callable[[], int], env: dict[str, str], stderr: IO[str]) -> None:
        self.returncode: int | None = None
        sys.stdout.flush()
        sys.stderr.flush()  # what the parent buffered must not be written by the child too
        self.pid = os.fork()
        if self.pid == 0:
            code = 1
            try:
                os.environ.clear()
                os.environ.update(env)
                # The descriptors for C's writes, Python's streams on them as in a new process
                # (the parent's may be another's: pytest's capture)
                sys.stdout = open(os.devnull, "w")  # noqa: SIM115 (os._exit closes it)
                os.dup2(sys.stdout.fileno(), 1)
                os.dup2(stderr.fileno(), 2)
                sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115
                code = fn()
            except BaseException:
                traceback.print_exc()
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)

    def poll(self) -> int | None:
        if self.returncode is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        end = None if timeout is None else time.monotonic() + timeout
        while (code := self.poll()) is None:
            if end is not None and time.monotonic() > end:
                raise subprocess.TimeoutExpired(f"forked {self.pid}", timeout or 0)
            time.sleep(0.02)
        return code

    def kill(self) -> None:
        if self.poll() is None:
            os.kill(self.pid, signal.SIGKILL)


def _start(command: Command, env: dict[str, str], stderr: IO[str]) -> subprocess.Popen | Forked:
    if callable(command):
        return Forked(command, env, stderr)
    return subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=stderr)


@dataclass
class SideResult:
    returncode: int
    stderr: str


class _Peer:
    def __init__(self, conn: socket.socket) -> None:
        self.conn, self.reader = conn, conn.makefile("r")

    def read(self) -> str:
        line = self.reader.readline().strip()
        if not line:
            raise ConnectionError("a measured process ended in the middle of its window")
        return line

    def go(self) -> None:
        self.conn.sendall(b"go\n")


def run_in_turns(
    commands: dict[str, tuple[Command, int]], env: dict[str, str], timeout: float = 300
) -> dict[str, SideResult]:
    """Run each side's command (`side -> (command, its processes that take turns)`) at once, in
    turns as the module's docstring says, to the end; each side's exit code and stderr. A process
    that dies or stops answering ends the round: every side is killed, and their stderr says
    why."""
    with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as files:
        path = str(Path(tmp) / "turns.sock")
        server = files.enter_context(socket.socket(socket.AF_UNIX, socket.SOCK_STREAM))
        server.bind(path)
        server.listen(64)
        server.settimeout(1.0)  # accept() looks at the sides' processes once a second
        logs = {
            side: files.enter_context(open(Path(tmp) / f"{i}.err", "w+"))
            for i, side in enumerate(commands)
        }
        procs = {
            side: _start(command, {**env, ENV: path}, logs[side])
            for side, (command, _) in commands.items()
        }
        try:
            _take_turns(server, procs, commands, timeout)
        except (OSError, subprocess.TimeoutExpired) as e:
            for proc in procs.values():
                with contextlib.suppress(OSError):
                    proc.kill()
                proc.wait()
            for log in logs.values():
                log.write(f"\n(lockstep: the round ended: {e!r})\n")
        results = {}
        for side, log in logs.items():
            log.seek(0)
            results[side] = SideResult(procs[side].returncode, log.read())
        return results


def _take_turns(
    server: socket.socket,
    procs: dict[str, subprocess.Popen | Forked],
    commands: dict[str, tuple[Command, int]],
    timeout: float,
) -> None:
    peers: dict[str, list[_Peer]] = {side: [] for side in commands}
    for _ in range(sum(n for _, n in commands.values())):
        conn = _accept(server, procs, timeout)
        conn.settimeout(timeout)
        peer = _Peer(conn)
        peers[peer.read()].append(peer)
    for side_peers in peers.values():  # every side's warm-up over before any slice
        for peer in side_peers:
            if peer.read() != "ready":
                raise ConnectionError("a side had no window to time")
    active = list(commands)
    while active:
        for side in list(active):
            for peer in peers[side]:
                peer.go()
            said = {peer.read() for peer in peers[side]}
            if said == {"done"}:
                active.remove(side)
            elif said != {"ready"}:
                raise ConnectionError(f"{side}: its processes' windows differ ({said})")
    for side_peers in peers.values():  # every side's teardown after every window
        for peer in side_peers:
            peer.go()
    for proc in procs.values():
        proc.wait(timeout=timeout)


def _accept(
    server: socket.socket, procs: dict[str, subprocess.Popen | Forked], timeout: float
) -> socket.socket:
    """The next process's connection; an error as soon as a side's process has ended instead."""
    for _ in range(int(timeout)):
        with contextlib.suppress(TimeoutError):
            return server.accept()[0]
        if ended := [side for side, proc in procs.items() if proc.poll() is not None]:
            raise ConnectionError(f"{', '.join(ended)} ended before its window")
    raise TimeoutError(f"not every process said hello in {timeout:.0f} s")
