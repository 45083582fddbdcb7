"""The step vote in a real 2-process gloo group: both ranks act at the same step on a flag that
only one rank raised, the vote never touches the training group, and votes are spaced by time
rather than cast every step."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from ae.training.step_vote import NOTHING, Decision, StepVote
from tests.support.runs import ROOT

# Each rank: 80 "steps" of a training-group all-reduce and ~5 ms of work; rank 1 raises the
# stop flag from step 20 on. The vote's spacing is 25 ms, so about every 5 steps.
SCRIPT = """
import json, sys, time
from datetime import timedelta
import torch, torch.distributed as dist
import torch.multiprocessing as mp
from ae.training.step_vote import Decision, StepVote

def rank_main(rank, store_file, out):
    dist.init_process_group("gloo", init_method=f"file://{store_file}", rank=rank, world_size=2)
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
        if vote.cast(step, lambda: Decision(stop=rank == 1 and step >= 20)):
            cast.append(step)
    vote.finish()
    json.dump({"cast": cast, "acted": acted, "stop_at": stop_at,
               "vote_backend": str(dist.get_backend(vote.group))},
              open(f"{out}/rank{rank}.json", "w"))
    dist.barrier()
    dist.destroy_process_group()

if __name__ == "__main__":
    mp.spawn(rank_main, args=(sys.argv[1], sys.argv[2]), nprocs=2)
"""


def _run(tmp_path: Path) -> dict[int, dict]:
    script = tmp_path / "vote_ranks.py"
    script.write_text(SCRIPT)
    res = subprocess.run(
        [sys.executable, str(script), str(tmp_path / "store"), str(tmp_path)],
        cwd=ROOT, capture_output=True, text=True, timeout=180,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr[-3000:]
    return {r: json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)}


@pytest.mark.slow
def test_both_ranks_stop_at_the_same_step_on_one_ranks_flag(tmp_path: Path) -> None:
    ranks = _run(tmp_path)
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
