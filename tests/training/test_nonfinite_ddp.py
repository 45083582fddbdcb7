"""The non-finite guard under DDP: in a real 2-process gloo group, the rank whose own gradient
or loss turned NaN is named (the others only received it); on a 1-process gloo group, its
comm hook reduces as DDP does and starts the all-reduce clock."""

from __future__ import annotations

import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from loguru import logger
from torch.nn.parallel import DistributedDataParallel

from ae.config import CheckpointConfig, OptimConfig
from ae.log_lines import NONFINITE_RECEIVED
from ae.training.checkpoint_files import CheckpointStore
from ae.training.nonfinite import NonFiniteError, NonFiniteGuard
from tests.support.forked_ranks import run_ranks
from tests.training.tiny_linear_module import Tiny


# Two ranks in a real gloo group, the guard's DDP comm hook on a DDP-wrapped model; the trainer
# is reduced to what the guard reads of it. Each rank a process forked from this one.
def _case(rank: int, store: str, bad_grad_rank: int, nan_loss_rank: int) -> str:
    torch.manual_seed(0)
    module = Tiny()
    ddp = DistributedDataParallel(module)
    guard = NonFiniteGuard(OptimConfig(), CheckpointConfig(), CheckpointStore(store, 3), "32")
    trainer = SimpleNamespace(
        strategy=SimpleNamespace(model=ddp), log_every_n_steps=10, global_step=0,
        is_global_zero=rank == 0, global_rank=rank, current_epoch=0, datamodule=None)  # fmt: skip
    guard.on_train_start(trainer, module)
    if rank == bad_grad_rank:  # this rank's own gradient turns NaN; its loss stays finite
        module.net.weight.register_hook(lambda g: g * float("nan"))
    loss = ddp(torch.rand(2, 4)).pow(2).mean()
    seen = float("nan") * loss if rank == nan_loss_rank else loss  # what the guard is shown
    guard.on_before_backward(trainer, module, seen)
    loss.backward()
    try:
        guard.on_before_optimizer_step(trainer, module, None)
        return "went on"
    except NonFiniteError:
        return "stopped"


def _rank_cases(rank: int, store: str) -> dict[str, list]:
    lines: list[str] = []
    logger.remove()  # the rank's own logger (a forked process): the test process's is untouched
    logger.add(lambda m: lines.append(m.record["message"].split(" (")[0]), level="INFO")
    result = {}
    for name, bad_grad, nan_loss in (("fine", -1, -1), ("grad", 1, -1), ("loss", -1, 0)):
        lines.clear()
        result[name] = [_case(rank, store, bad_grad, nan_loss), list(lines)]
    dist.barrier()
    return result


@pytest.mark.slow
def test_the_rank_whose_own_gradient_or_loss_turned_nan_is_named_under_ddp(tmp_path: Path) -> None:
    r0, r1 = run_ranks(_rank_cases, str(tmp_path))
    RECEIVED = NONFINITE_RECEIVED.format(step=1).split(" (")[0]
    assert r0["fine"] == r1["fine"] == ["went on", []]
    # Rank 1's own gradient: it names itself (the gradient), rank 0 only received the NaN.
    assert r1["grad"][0] == r0["grad"][0] == "stopped"
    assert r1["grad"][1][0] == "NONFINITE gradient=nan in net.weight on rank 1 at step 1"
    assert r0["grad"][1][0] == RECEIVED, r0["grad"]
    # Rank 0's loss alone (its gradients finite): the NaN it adds to the bucket reaches rank 1.
    assert r0["loss"][1][0] == "NONFINITE loss=nan on rank 0 at step 1"
    assert r1["loss"][1][0] == RECEIVED, r1["loss"]


def test_the_comm_hook_reduces_as_ddp_does_and_starts_the_all_reduce_clock(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On a real (1-process gloo) DDP model: the guard's comm hook gives DDP's gradients, and
    notes when the last bucket's all-reduce started (the step clock's sync, ae.forensics). On
    gloo it reduces on the thread that runs backward: torch's `allreduce_hook` is not called
    (its future callback would run on gloo's thread)."""
    from ae.forensics import step_times as st
    from ae.training import nonfinite

    def refused(*args: object) -> None:
        raise AssertionError("allreduce_hook called on gloo")

    monkeypatch.setattr(nonfinite, "allreduce_hook", refused)

    times = st.StepTimes()
    monkeypatch.setattr(st, "step_times", times)
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0,
                            world_size=1)  # fmt: skip
    try:
        torch.manual_seed(0)
        plain, module = Tiny(), Tiny()
        module.load_state_dict(plain.state_dict())
        ddp = DistributedDataParallel(module)
        guard = NonFiniteGuard(
            OptimConfig(), CheckpointConfig(), CheckpointStore(tmp_path, 3), "32"
        )
        trainer = SimpleNamespace(strategy=SimpleNamespace(model=ddp), log_every_n_steps=10)
        guard.on_train_start(trainer, module)
        x = torch.randn(3, 4)
        times.fetched(0.0, 0.0)
        before = time.perf_counter()
        ddp(x).sum().backward()
        assert times.last_grad_ready is not None and times.last_grad_ready >= before
        times.backward_done(time.perf_counter())
        assert len(times._collectives) == 1  # the wait after the last bucket, timed
        plain(x).sum().backward()
        for a, b in zip(module.parameters(), plain.parameters(), strict=True):
            assert torch.allclose(a.grad, b.grad)  # the mean over 1 rank: the same gradients
        assert guard.grad_sum is not None and torch.isfinite(guard.grad_sum)
    finally:
        dist.destroy_process_group()
