"""Ranks of a real gloo group, forked from the test's own process.

A test of a collective (a vote, an all-reduce hook, a metric's sync) needs two processes in one
gloo group, not two fresh interpreters: each fresh one imported torch again (~3 s of CPU, three
per test where a script spawned its ranks). Forked from the pytest process, which has torch and
the project imported already, a rank costs what it runs. Each rank is still its own process with
its own memory, joined by gloo over a file store, as the ranks of a run are over TCP.
"""

from __future__ import annotations

import multiprocessing
import os
import tempfile
import time
import traceback
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

import torch
import torch.distributed as dist


def _rank(
    fn: Callable[..., Any], rank: int, world: int, store: str, conn: Connection, args: tuple
) -> None:
    # libgomp's thread pool does not survive a fork: a parallel region in the child would wait
    # on the parent's threads forever (what a DataLoader worker avoids the same way)
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
        try:
            conn.send(("ok", fn(rank, *args)))
        finally:
            dist.destroy_process_group()
    except BaseException:  # the parent reports it, with the rank
        conn.send(("error", traceback.format_exc()))


def run_ranks(fn: Callable[..., Any], *args: Any, world: int = 2, timeout: float = 120) -> list:
    """`fn(rank, *args)` on `world` forked processes in one gloo group (the default group,
    initialized before `fn` runs, destroyed after); what each returned, by rank. A rank that
    raised fails the test with its traceback; ranks still running after `timeout` s are killed."""
    assert not dist.is_initialized(), "the test process holds a process group: the ranks can't"
    ctx = multiprocessing.get_context("fork")
    with tempfile.TemporaryDirectory(prefix="ae-ranks-") as tmp:
        pipes = [ctx.Pipe(duplex=False) for _ in range(world)]
        procs = [
            ctx.Process(target=_rank, args=(fn, r, world, os.path.join(tmp, "store"), w, args))
            for r, (_, w) in enumerate(pipes)
        ]
        for p, (_, write) in zip(procs, pipes, strict=True):
            p.start()
            write.close()  # the rank's end: a rank that dies unheard is an EOF here, not a wait
        try:
            deadline = time.monotonic() + timeout
            said = {}
            for rank, (read, _) in enumerate(pipes):
                if read.poll(max(0.0, deadline - time.monotonic())):
                    try:
                        said[rank] = read.recv()
                    except EOFError:
                        procs[rank].join(5)
                        said[rank] = ("died", f"without a word (exit {procs[rank].exitcode})")
            # every rank's failure, not only the first: the rank that broke first is the cause,
            # the others' failures (a peer that left the group) only follow from it
            failed = [f"rank {r} failed:\n{value}" for r, (st, value) in said.items() if st != "ok"]
            silent = [
                f"rank {r} said nothing in {timeout} s" for r in range(world) if r not in said
            ]
            assert not failed and not silent, "\n".join(silent + failed)
            for p in procs:
                p.join(max(1.0, deadline - time.monotonic()))
            assert [p.exitcode for p in procs] == [0] * world, [p.exitcode for p in procs]
            return [said[r][1] for r in range(world)]
        finally:
            for p in procs:
                if p.is_alive():
                    p.kill()
                    p.join()
