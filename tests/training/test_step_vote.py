"""The step vote between 2 real processes through a real c10d store (a TCPStore server, found
through MASTER_ADDR/MASTER_PORT as a rank finds the job's): both ranks act at the same step on a
flag that only one rank raised, votes are spaced by time rather than cast every step, the store
keeps no more than the rounds still to be read, and a rank whose peer has not cast yet waits
for it (then gives up, naming the count, at the timeout)."""

from __future__ import annotations

import os
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from ae.training.step_vote import NOTHING, Decision, StepVote
from tests.support.forked_ranks import run_ranks


def _job_store(rank: int) -> dist.TCPStore | None:
    """Rank 0 serves a store, as torchrun's agent or rank 0 of a job does; both ranks point
    MASTER_ADDR/MASTER_PORT at it. The server, on rank 0."""
    server = (
        dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False) if rank == 0 else None
    )
    port = [server.port if server else 0]
    dist.broadcast_object_list(port, src=0)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port[0]))
    return server


# Each rank: 80 "steps" of a training-group all-reduce and ~5 ms of work; rank 1 raises the
# stop flag from step 20 on.
def _rank_steps(rank: int) -> dict:
    server = _job_store(rank)
    # ~20 steps of 5 ms between votes; still several when a loaded machine makes a step 25 ms
    vote = StepVote(every_s=0.1)
    vote.start(2, timedelta(seconds=60))
    training = dist.group.WORLD
    cast, acted, stop_at = [], [], None
    for step in range(1, 81):
        dist.all_reduce(torch.zeros(4), group=training)  # the step's gradient all-reduce
        time.sleep(0.005)
        agreed = vote.answer(step, lambda: Decision())
        if agreed != Decision():
            acted.append([step, agreed.stop, agreed.save])
        if agreed.stop:
            stop_at = step
            break
        if vote.cast(step, lambda step=step: Decision(stop=rank == 1 and step >= 20)):
            cast.append(step)
    dist.barrier()
    kept = []
    if server is not None:  # the rounds still in the store: the last one read, none before
        kept = [r for r in range(len(cast)) if server.check([f"ae/vote/1/{r}"])]
    return {"cast": cast, "acted": acted, "stop_at": stop_at, "kept": kept}


@pytest.mark.slow
def test_both_ranks_stop_at_the_same_step_on_one_ranks_flag() -> None:
    r0, r1 = run_ranks(_rank_steps)
    assert r0["stop_at"] == r1["stop_at"] is not None  # rank 0 never raised the flag
    assert r0["acted"] == r1["acted"] == [[r0["stop_at"], True, False]]
    assert r0["cast"] == r1["cast"]  # the same vote steps, counted from the same answers
    stop = r0["stop_at"]
    first_vote_after_flag = min(s for s in r0["cast"] if s >= 20)
    assert stop == first_vote_after_flag + 1  # read one step after the vote that carried it
    # Spaced by time, not every step: after the first answer, a vote every few steps.
    gaps = [b - a for a, b in zip(r0["cast"], r0["cast"][1:], strict=False)]
    assert len(r0["cast"]) < stop / 2, r0["cast"]
    assert max(gaps) > 1, gaps
    assert r0["kept"] == [len(r0["cast"]) - 1], r0["kept"]  # the rounds before it deleted


# Rank 1 casts its flag 0.3 s after rank 0 reads (a peer whose CPU is behind), then never casts
# the second vote, which rank 0 reads with a 0.5 s timeout.
def _rank_late_peer(rank: int) -> dict:
    server = _job_store(rank)  # noqa: F841  # held: the store serves as long as it lives
    vote = StepVote(every_s=0.0)
    vote.start(2, timedelta(seconds=0.5))
    said: dict = {}
    if rank == 1:
        time.sleep(0.3)
        vote.cast(1, lambda: Decision(save=True))
    else:
        vote.cast(1, lambda: NOTHING)
        t0 = time.monotonic()
        said["answer"] = vote.answer(2, lambda: NOTHING)
        said["waited_s"] = time.monotonic() - t0
        vote.cast(2, lambda: NOTHING)
        try:
            vote.answer(3, lambda: NOTHING)
        except RuntimeError as e:
            said["gave_up"] = str(e)
    dist.barrier()
    return said


def test_a_peer_not_yet_cast_is_waited_for_then_given_up_on_with_the_count() -> None:
    r0, _ = run_ranks(_rank_late_peer)
    assert r0["answer"] == Decision(save=True)  # rank 1's flag, read once it was there
    assert r0["waited_s"] >= 0.2, r0
    assert "step vote read at step 3: 1 of 2 ranks cast it" in r0["gave_up"], r0


def test_one_process_decides_alone_at_every_step() -> None:
    vote = StepVote()
    vote.start(1, timeout=None)  # type: ignore[arg-type]  # no store is needed for one process
    assert not vote.voting
    assert vote.answer(3, lambda: Decision(stop=True)) == Decision(stop=True)
    assert vote.answer(4, lambda: Decision(save=True)) == Decision(save=True)
    assert not vote.cast(4, lambda: Decision(stop=True))  # nothing to send
    assert vote.answer(5, lambda: NOTHING) == NOTHING
