"""The non-finite guard in a real single-process fit: a NaN loss is named with its step and
batch, `skip` leaves the weights as they were and goes on, `stop` raises; the save guard's check
finds the first non-finite tensor; the sample description names non-finite inputs alone."""

from __future__ import annotations

import json
import math
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import lightning as L
import pytest
import torch
import torch.distributed as dist
from loguru import logger
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader

from ae.config import CheckpointConfig, OptimConfig
from ae.data.stream.batch_members import Member
from ae.log_lines import NONFINITE_RECEIVED
from ae.training.checkpoint_files import CheckpointStore
from ae.training.nonfinite import NonFiniteError, NonFiniteGuard, describe_members, nonfinite_in
from tests.support.runs import ROOT

NAN_BATCH = 3  # the 4th batch holds a NaN: optimizer step 4


class Tiny(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Linear(4, 4)
        self.weights: dict[int, torch.Tensor] = {}  # after each optimizer step

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: torch.Tensor, idx: int) -> torch.Tensor:
        return ((self.net(batch) - batch) ** 2).mean()

    def on_train_batch_end(self, outputs, batch, idx) -> None:
        self.weights[self.trainer.global_step] = self.net.weight.detach().clone()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=0.1)


@pytest.fixture
def caplog_lines():
    """The messages loguru writes meanwhile."""
    lines: list[str] = []
    sink = logger.add(lambda m: lines.append(m.record["message"]), level="INFO")
    yield lines
    logger.remove(sink)


def batches() -> list[torch.Tensor]:
    out = [torch.rand(2, 4) for _ in range(8)]
    out[NAN_BATCH][1, 2] = float("nan")
    return out


def fit(
    tmp_path: Path, mode: str, data: list[torch.Tensor] | None = None
) -> tuple[Tiny, NonFiniteGuard]:
    guard = NonFiniteGuard(
        OptimConfig(on_nonfinite=mode, max_skipped_steps=1), CheckpointConfig(),
        CheckpointStore(tmp_path, 3), "32",
    )  # fmt: skip
    model = Tiny()
    trainer = L.Trainer(
        accelerator="cpu", max_epochs=1, callbacks=[guard], logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        default_root_dir=tmp_path,
    )  # fmt: skip
    data = batches() if data is None else data
    trainer.fit(model, train_dataloaders=DataLoader(data, batch_size=None))
    return model, guard


def test_skip_leaves_the_weights_of_the_nan_step_and_goes_on(tmp_path: Path, caplog_lines) -> None:
    model, guard = fit(tmp_path, "skip")
    assert guard.skipped == 1
    step = NAN_BATCH + 1
    assert torch.equal(model.weights[step], model.weights[step - 1])  # not applied
    assert not torch.equal(model.weights[step + 1], model.weights[step])  # and on it went
    assert all(torch.isfinite(w).all() for w in model.weights.values())
    [line] = [m for m in caplog_lines if m.startswith("NONFINITE")]
    assert line.startswith(f"NONFINITE loss=nan on rank 0 at step {step} (epoch 0, batch 3): ")


def test_stop_raises_at_the_nan_step(tmp_path: Path) -> None:
    with pytest.raises(NonFiniteError, match=f"step {NAN_BATCH + 1}") as stopped:
        fit(tmp_path, "stop")
    # Nothing survived under stop, and nothing is said to have (`0 of at most 10 survived`)
    assert f"step {NAN_BATCH + 1} (--on_nonfinite=stop): " in str(stopped.value)


def test_skip_past_its_limit_says_so(tmp_path: Path) -> None:
    data = batches()
    data[NAN_BATCH + 2][0, 0] = float("nan")  # the second NaN step, past --max_skipped_steps=1
    with pytest.raises(NonFiniteError) as stopped:
        fit(tmp_path, "skip", data)
    assert f"step {NAN_BATCH + 3} (--on_nonfinite=skip; 1 of at most 1 steps skipped already " in (
        str(stopped.value)
    )


class Losses(L.Callback):
    """Each batch's loss as training_step returned it."""

    def __init__(self) -> None:
        self.seen: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, idx) -> None:
        self.seen.append(float(outputs["loss"]))


def test_the_epoch_mean_leaves_out_the_skipped_step(tmp_path: Path) -> None:
    """A run that skipped its NaN step reported `train/loss_epoch=nan` (the NaN was in the
    mean): the mean is over the steps applied."""
    from ae.config import ModelConfig
    from ae.data.decoding.decode import InputSpec
    from ae.training.model import AutoEncoder

    torch.manual_seed(0)
    model = AutoEncoder(InputSpec("vector", (4,)), ModelConfig(hidden_dim=8, latent_dim=2))
    guard = NonFiniteGuard(OptimConfig(on_nonfinite="skip"), CheckpointConfig(),
                           CheckpointStore(tmp_path, 3), "32")  # fmt: skip
    losses = Losses()
    trainer = L.Trainer(
        accelerator="cpu", max_epochs=1, callbacks=[guard, losses], logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        default_root_dir=tmp_path,
    )  # fmt: skip
    trainer.fit(model, train_dataloaders=DataLoader(batches(), batch_size=None))
    assert guard.skipped == 1 and math.isnan(losses.seen[NAN_BATCH])
    kept = [x for i, x in enumerate(losses.seen) if i != NAN_BATCH]
    mean = trainer.callback_metrics["train/loss_epoch"]
    assert float(mean) == pytest.approx(sum(kept) / len(kept))


def test_an_injected_nan_names_the_step_its_nonfinite_line_names(
    tmp_path: Path, caplog_lines, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`nan@train:step=2` fires at global step 2 (2 optimizer steps done, as the key says): the
    batch of optimizer step 3, which the NONFINITE line names. The FAULT line said only `at step
    2`, beside `NONFINITE ... at step 3`; it names the step it poisons now."""
    from ae.config import ModelConfig
    from ae.data.decoding.decode import InputSpec
    from ae.forensics import faults
    from ae.log_lines import FAULT_INJECTED, NONFINITE
    from ae.training.model import AutoEncoder

    monkeypatch.setattr(faults, "_faults", faults.parse_faults("nan@train:step=2"))
    monkeypatch.setattr(faults, "_fired", set())
    monkeypatch.setenv("RANK", "0")
    model = AutoEncoder(InputSpec("vector", (4,)), ModelConfig(hidden_dim=8, latent_dim=2))
    guard = NonFiniteGuard(OptimConfig(on_nonfinite="skip"), CheckpointConfig(),
                           CheckpointStore(tmp_path, 3), "32")  # fmt: skip
    trainer = L.Trainer(
        accelerator="cpu", max_steps=4, callbacks=[guard], logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        default_root_dir=tmp_path,
    )  # fmt: skip
    data = [torch.rand(2, 4) for _ in range(4)]
    trainer.fit(model, train_dataloaders=DataLoader(data, batch_size=None))
    [fault] = [m for line in caplog_lines if (m := FAULT_INJECTED.parse(line))]
    [named] = [m for line in caplog_lines if (m := NONFINITE.parse(line))]
    assert (fault["step"], named["step"], guard.events) == ("2", "3", [(3, "non-finite")])
    assert fault["effect"] == ": the loss of optimizer step 3 turns NaN"


def test_a_dropped_step_takes_all_its_batches_out_of_the_mean() -> None:
    """Under gradient accumulation a step is several batches: a dropped step takes them all,
    the finite ones too; an epoch of dropped steps alone has no mean."""
    from ae.training.epoch_loss import EpochLoss

    mean = EpochLoss()
    for step, losses in enumerate([(1.0, 3.0), (5.0, float("nan")), (2.0, 6.0)]):
        for loss in losses:
            mean.add(torch.tensor(loss), step)
        if step == 1:  # what the guard does before that step's optimizer step
            mean.drop_step()
    share = mean.share(torch.device("cpu"))
    assert share is not None and (float(share[0]), share[1]) == (3.0, 4)
    mean.start()
    mean.add(torch.tensor(float("nan")), 7)
    mean.drop_step()
    assert mean.share(torch.device("cpu")) is None


def test_the_state_check_names_the_first_non_finite_tensor() -> None:
    ok, bad = torch.ones(3), torch.tensor([1.0, float("inf")])
    assert nonfinite_in([("a", ok), ("steps", torch.tensor(3)), ("b", bad), ("c", bad)]) == "b"
    assert nonfinite_in([("a", ok)]) is None


def test_samples_with_non_finite_input_are_named_alone() -> None:
    members = [Member("a.tar", "k1", True), Member("a.tar", "k2", False),
               Member("b.tar", "k3", True)]  # fmt: skip
    assert describe_members(members) == "shard a.tar, keys [k2] (non-finite input)"
    fine = [m for m in members if m.finite]
    assert describe_members(fine) == "shard a.tar, keys [k1]; shard b.tar, keys [k3]"


def test_a_finite_loss_far_above_its_mean_is_a_spike(tmp_path: Path, caplog_lines) -> None:
    data = [torch.full((2, 4), 0.5) for _ in range(40)]
    data[30] = torch.full((2, 4), 50.0)  # step 31: a loss ~10^4 times the others
    guard = NonFiniteGuard(OptimConfig(), CheckpointConfig(), CheckpointStore(tmp_path, 3), "32")
    trainer = L.Trainer(
        accelerator="cpu", max_epochs=1, callbacks=[guard], logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        default_root_dir=tmp_path,
    )  # fmt: skip
    torch.manual_seed(0)  # the same weights every time: the steps after the spike are calm
    trainer.fit(Tiny(), train_dataloaders=DataLoader(data, batch_size=None))
    assert guard.events == [(31, "loss spike")]
    [line] = [m for m in caplog_lines if m.startswith("LOSS SPIKE")]
    assert " on rank 0 at step 31 (epoch 0, batch 30), " in line


def test_the_loss_curve_draws_the_marks(tmp_path: Path) -> None:
    from ae.training.plots import loss_plot

    series = {"train/loss": [(float(s), 1.0 / s) for s in range(1, 50)]}
    loss_plot(series, tmp_path / "plain.png")
    loss_plot(series, tmp_path / "marked.png", marks=[(20, "loss spike"), (30, "non-finite")])
    assert (tmp_path / "plain.png").read_bytes() != (tmp_path / "marked.png").read_bytes()


@pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA: weights there, Adam's step on the CPU"
)
def test_the_save_guard_reads_a_state_on_two_devices() -> None:
    """The state of a GPU run mixes devices (Adam's `step` stays on the CPU): found on an H200,
    where the save guard's single stack failed the first checkpoint save."""
    bad = torch.tensor([1.0, float("nan")], device="cuda")
    named = [("step", torch.tensor(3.0)), ("w", torch.ones(2, device="cuda")), ("b", bad)]
    assert nonfinite_in(named) == "b"


def test_the_clipping_uses_the_guards_norm_and_clips_as_lightning_does(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The guard measures each step's gradient norm; the clipping takes it rather than measure
    again (one pass over the gradients a step, not two), with the weights Lightning's own
    clipping gives."""
    from ae.config import ModelConfig
    from ae.data.decoding.decode import InputSpec
    from ae.training.model import AutoEncoder

    def counted(name: str) -> list[int]:
        calls: list[int] = []
        real = getattr(torch.nn.utils, name)
        monkeypatch.setattr(torch.nn.utils, name, lambda *a, **k: calls.append(1) or real(*a, **k))
        return calls

    norms, clipped = counted("get_total_norm"), counted("clip_grad_norm_")
    data = [torch.rand(8, 12, generator=torch.Generator().manual_seed(i)) for i in range(6)]

    def weights(with_guard: bool) -> list[torch.Tensor]:
        torch.manual_seed(0)
        model = AutoEncoder(InputSpec("vector", (12,)), ModelConfig(hidden_dim=16, latent_dim=3),
                            OptimConfig(learning_rate=0.05, warmup_steps=0))  # fmt: skip
        guard = NonFiniteGuard(
            OptimConfig(), CheckpointConfig(), CheckpointStore(tmp_path, 3), "32"
        )
        trainer = L.Trainer(
            accelerator="cpu", max_epochs=1, gradient_clip_val=0.01, logger=False,
            callbacks=[guard] if with_guard else [], enable_checkpointing=False,
            enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path,
        )  # fmt: skip
        trainer.fit(model, train_dataloaders=DataLoader(data, batch_size=None))
        return [p.detach().clone() for p in model.parameters()]

    guarded = weights(with_guard=True)
    assert len(norms) == len(data) and not clipped  # one norm a step, Lightning's clip unused
    lightnings = weights(with_guard=False)
    assert len(clipped) == len(data)
    assert all(torch.allclose(a, b, atol=1e-7) for a, b in zip(guarded, lightnings, strict=True))


# Two ranks in a real gloo group, the guard's DDP comm hook on a DDP-wrapped model; the trainer
# is reduced to what the guard reads of it. Forked from one interpreter that imported torch.
DDP_SCRIPT = """
import json, sys, types
import torch, torch.distributed as dist
import torch.multiprocessing as mp
import lightning as L
from loguru import logger
from torch.nn.parallel import DistributedDataParallel
from ae.config import CheckpointConfig, OptimConfig
from ae.training.checkpoint_files import CheckpointStore
from ae.training.nonfinite import NonFiniteError, NonFiniteGuard

class Tiny(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Linear(4, 4)

    def forward(self, x):
        return self.net(x)

def case(rank, bad_grad_rank, nan_loss_rank):
    torch.manual_seed(0)
    module = Tiny()
    ddp = DistributedDataParallel(module)
    guard = NonFiniteGuard(OptimConfig(), CheckpointConfig(), CheckpointStore(sys.argv[2], 3), "32")
    trainer = types.SimpleNamespace(
        strategy=types.SimpleNamespace(model=ddp), log_every_n_steps=10, global_step=0,
        is_global_zero=rank == 0, global_rank=rank, current_epoch=0, datamodule=None)
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

def rank_main(rank, store, out):
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    lines = []
    logger.remove()
    logger.add(lambda m: lines.append(m.record["message"].split(" (")[0]), level="INFO")
    result = {}
    for name, bad_grad, nan_loss in (("fine", -1, -1), ("grad", 1, -1), ("loss", -1, 0)):
        lines.clear()
        result[name] = [case(rank, bad_grad, nan_loss), list(lines)]
    json.dump(result, open(f"{out}/rank{rank}.json", "w"))
    dist.barrier()
    dist.destroy_process_group()

if __name__ == "__main__":
    mp.start_processes(rank_main, args=(sys.argv[1], sys.argv[3]), nprocs=2, start_method="fork")
"""


@pytest.mark.slow
def test_the_rank_whose_own_gradient_or_loss_turned_nan_is_named_under_ddp(tmp_path: Path) -> None:
    script = tmp_path / "guard_ranks.py"
    script.write_text(DDP_SCRIPT)
    res = subprocess.run(
        [sys.executable, str(script), str(tmp_path / "store"), str(tmp_path), str(tmp_path)],
        cwd=ROOT, capture_output=True, text=True, timeout=180,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr[-3000:]
    r0, r1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1))
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
