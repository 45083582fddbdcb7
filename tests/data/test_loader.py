"""Dataloader workers that ignore SIGTERM must not keep their rank from exiting."""

from __future__ import annotations

import subprocess
import sys
import textwrap

from tests.support.runs import ROOT

SCRIPT = textwrap.dedent(
    """
    import sys, torch
    from torch.utils.data import IterableDataset
    from ae.data.loader import PreemptibleLoader, install_worker_reaper

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
