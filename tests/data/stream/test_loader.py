"""Dataloader workers that ignore SIGTERM must not keep their rank from exiting; the wait before
workers fork comes only when they do."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from types import SimpleNamespace

import pytest
import torch

from ae.data.stream import loader as loader_module
from tests.support.runs import ROOT

SCRIPT = textwrap.dedent(
    """
    import sys, torch
    from torch.utils.data import IterableDataset
    from ae.data.stream.loader import PreemptibleLoader, install_worker_reaper

    install_worker_reaper()  # what the rank's entry point does

    class Endless(IterableDataset):
        def __iter__(self):
            while True:
                yield torch.zeros(2)

    def train():
        batches = iter(PreemptibleLoader(Endless(), batch_size=None, num_workers=1))
        next(batches)
        raise RuntimeError("a training step failed")

    try:
        train()
    except RuntimeError as e:
        kept = e  # the traceback keeps the iterator, and its worker, alive until exit
    sys.exit(2)
    """
)


def test_rank_leaving_on_an_exception_exits_despite_live_workers() -> None:
    """Workers ignore SIGTERM; the reaper the entry point installs kills them at exit."""
    res = subprocess.run(
        [sys.executable, "-c", SCRIPT], cwd=ROOT, capture_output=True, text=True, timeout=30
    )
    assert res.returncode == 2, res.stderr
    assert "killed by signal" not in res.stderr  # no noise from torch's worker watchdog


def test_the_fork_settle_wait_comes_only_before_workers_are_forked(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Persistent workers are forked by the first epoch's iterator alone: one wait in a run;
    other workers at every epoch; none without workers."""
    waits: list[float] = []
    monkeypatch.setattr(loader_module, "time", SimpleNamespace(sleep=waits.append))
    data = torch.arange(4.0)
    runs = {"persistent": (1, True), "per epoch": (1, False), "no workers": (0, False)}
    counted = {}
    for name, (workers, persistent) in runs.items():
        waits.clear()
        loader = loader_module.PreemptibleLoader(
            data, batch_size=2, num_workers=workers, persistent_workers=persistent
        )
        epochs = [torch.cat(list(loader)).tolist() for _ in range(3)]
        assert epochs == [data.tolist()] * 3
        counted[name] = len(waits)
    assert counted == {"persistent": 1, "per epoch": 3, "no workers": 0}
