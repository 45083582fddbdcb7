"""`--ema_decay`'s average (`ae.training.ema.EMA`): after the first optimizer step the average is
the weights; after each further one, decay x average + (1 - decay) x weights, for every float
tensor, buffers included."""

from __future__ import annotations

from types import SimpleNamespace

import lightning as L
import torch

from ae.training.ema import EMA, averaged_weights


class Net(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(3, 2)
        self.norm = torch.nn.BatchNorm1d(2)  # float buffers (running stats) and an int64 one


def _floats(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    state = module.state_dict()
    return {k: v.clone() for k, v in state.items() if v.is_floating_point()}


def test_the_average_follows_the_ema_formula_over_three_steps() -> None:
    torch.manual_seed(0)
    net, decay = Net(), 0.9
    ema = EMA(decay)
    trainer = SimpleNamespace(global_step=0, callbacks=[ema])
    ema.setup(trainer, net, "fit")  # type: ignore[arg-type]
    expected: dict[str, torch.Tensor] = {}
    for step in (1, 2, 3):
        with torch.no_grad():  # an "optimizer step": new weights and running statistics
            for t in _floats(net):
                net.state_dict()[t].add_(torch.randn_like(net.state_dict()[t]))
        trainer.global_step = step
        ema.update(trainer, net)  # type: ignore[arg-type]
        now = _floats(net)
        if step == 1:
            expected = now
        else:
            expected = {k: decay * expected[k] + (1 - decay) * now[k] for k in now}
    live = _floats(net)
    with averaged_weights(trainer, net):  # type: ignore[arg-type]
        shown = _floats(net)
    for k in expected:
        torch.testing.assert_close(shown[k], expected[k], rtol=1e-6, atol=1e-6)
        assert not torch.equal(shown[k], live[k])
    # ... and the live weights are back, exactly, on the way out
    assert all(torch.equal(v, _floats(net)[k]) for k, v in live.items())


def test_one_update_per_optimizer_step() -> None:
    """The step boundary may call `update` again at the same step (a save, a sample): the
    average moves once per step."""
    net, ema = Net(), EMA(0.5)
    trainer = SimpleNamespace(global_step=1, callbacks=[ema])
    ema.setup(trainer, net, "fit")  # type: ignore[arg-type]
    ema.update(trainer, net)  # type: ignore[arg-type]
    with torch.no_grad():
        net.lin.weight.add_(1.0)
    trainer.global_step = 2
    ema.update(trainer, net)  # type: ignore[arg-type]
    with averaged_weights(trainer, net):  # type: ignore[arg-type]
        after_one = net.lin.weight.clone()
    ema.update(trainer, net)  # type: ignore[arg-type]  # same step again
    with averaged_weights(trainer, net):  # type: ignore[arg-type]
        assert torch.equal(net.lin.weight, after_one)
