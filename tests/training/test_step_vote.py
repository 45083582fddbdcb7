"""The step vote in a real 2-process gloo group: both ranks act at the same step on a flag that
only one rank raised, the vote never touches the training group, and votes are spaced by time
rather than cast every step."""

from __future__ import annotations

import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from ae.training.step_vote import NOTHING, Decision, StepVote
from tests.support.forked_ranks import run_ranks


# Each rank: 80 "steps" of a training-group all-reduce and ~5 ms of work; rank 1 raises the
# stop flag from step 20 on. The vote's spacing is 25 ms, so about every 5 steps.
def _rank_steps(rank: int) -> dict:
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
    vote.finish()
    said = {"cast": cast, "acted": acted, "stop_at": stop_at,
            "vote_backend": str(dist.get_backend(vote.group))}  # fmt: skip
    dist.barrier()
    return said


def _run() -> dict[int, dict]:
    """The two ranks, each a process forked from this one, in one gloo group."""
    return dict(enumerate(run_ranks(_rank_steps)))


@pytest.mark.slow
def test_both_ranks_stop_at_the_same_step_on_one_ranks_flag() -> None:
    ranks = _run()
    r0, r1 = ranks[0], ranks[1]
    assert r0["vote_backend"] == "gloo"
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


def test_one_process_decides_alone_at_every_step() -> None:
    vote = StepVote()
    vote.start(1, timeout=None)  # type: ignore[arg-type]  # no group is made for one process
    assert not vote.voting
    assert vote.answer(3, lambda: Decision(stop=True)) == Decision(stop=True)
    assert vote.answer(4, lambda: Decision(save=True)) == Decision(save=True)
    assert not vote.cast(4, lambda: Decision(stop=True))  # nothing to send
    assert vote.answer(5, lambda: NOTHING) == NOTHING
