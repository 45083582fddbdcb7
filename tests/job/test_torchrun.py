"""torchrun under the launcher: one stop signal is acted on, the next ones are ignored."""

from __future__ import annotations

import os
import signal

import pytest
from torch.distributed.elastic.multiprocessing import api

from ae.job.torchrun import once_per_stop


def test_a_second_stop_signal_does_not_break_torchruns_shutdown(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Was: under SLURM a requeue signalled torchrun twice (SLURM's SIGTERM and the launcher's);
    the second raised inside the agent's shutdown of the ranks, torchrun died, the ranks with
    it unsaved (`rank 0 killed without trace`)."""
    monkeypatch.setattr(api, "_terminate_process_handler", api._terminate_process_handler)
    names = ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT")
    before = {n: signal.getsignal(getattr(signal, n)) for n in names}
    try:
        once_per_stop()
        signal.signal(signal.SIGTERM, api._terminate_process_handler)  # as the agent does
        with pytest.raises(api.SignalException):
            os.kill(os.getpid(), signal.SIGTERM)
            signal.sigtimedwait([], 0.1)  # let the handler run
        os.kill(os.getpid(), signal.SIGTERM)  # the second: ignored, the shutdown goes on
        os.kill(os.getpid(), signal.SIGINT)
        assert all(signal.getsignal(getattr(signal, n)) == signal.SIG_IGN for n in names)
    finally:
        for n, h in before.items():
            signal.signal(getattr(signal, n), h)
