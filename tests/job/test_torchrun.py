"""torchrun under the launcher: one stop signal is acted on, the next ones are ignored; it waits
for the nodes to join as long as the contract says."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest
from torch.distributed.elastic.multiprocessing import api

from ae.config import RunConfig
from ae.job.elastic import agent_args
from ae.job.processes import JOIN_TIMEOUT_S, static_nodes
from ae.job.topology import Topology
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


def test_torchrun_waits_the_promised_join_timeout_for_the_nodes() -> None:
    """Was: without --max_restarts node 0 waited 900 s for a node that never joined, not the
    documented 600: torchrun's static rendezvous takes its timeout from the launch config, whose
    default (900) overrides the static backend's own 600. Read as torchrun reads its arguments."""
    from torch.distributed.run import config_from_args, parse_args

    topo = Topology(nnodes=2, node_rank=0, master_addr="10.0.0.1", master_port="29500", job="j")
    static = parse_args([*static_nodes(topo, "29500"), "--nproc_per_node=1", "-m", "x"])
    config, _, _ = config_from_args(static)
    assert config.rdzv_backend == "static"
    assert int(config.rdzv_configs["timeout"]) == JOIN_TIMEOUT_S == 600
    run = RunConfig(max_restarts=1)  # several nodes, restarts: the c10d rendezvous
    elastic = parse_args([*agent_args(run, topo, "29500", "10.0.0.1"), "--nproc_per_node=1", "x"])
    config, _, _ = config_from_args(elastic)
    assert int(config.rdzv_configs["join_timeout"]) == JOIN_TIMEOUT_S


def test_a_ctrl_c_in_its_imports_ends_torchruns_wrapper_quietly() -> None:
    """The launcher passes a Ctrl-C on as soon as the wrapper exists: during its imports (a
    second or two), Python's own handler printed a KeyboardInterrupt traceback from whichever
    import it interrupted onto the user's console. SIGINT is at its default before them."""
    code = (
        "import signal, sys\n"
        "class Spy:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name == 'logging_cfg':\n"
        "            print(signal.getsignal(signal.SIGINT) == signal.SIG_DFL)\n"
        "            sys.exit(0)\n"
        "sys.meta_path.insert(0, Spy())\n"
        "import runpy\n"
        "runpy.run_module('ae.job.torchrun', run_name='__main__')\n"  # as `python -m` runs it
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout == "True\n", out.stderr
