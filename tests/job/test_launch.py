"""The launcher, in-process: what it hands torchrun, and the user errors it stops at once."""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

import pytest

from ae.cli.launch import main
from ae.config import parse_config
from ae.config.weight_files import FID_FILE, FID_URL
from ae.data.shards import demo
from ae.forensics import faults
from ae.job import launch
from ae.job.folder_lock import acquire
from ae.job.peer_nodes import PeerNodes
from ae.job.preflight import MB, Need
from ae.job.supervise import Stops
from ae.job.topology import Topology
from ae.log_lines import LAUNCHER_LOG_FILE, PREEMPTED, TRAIN_LOG_FILE, TRAINING_FINISHED
from ae.run_paths import RunDir
from bench.synthetic_logs import T0, TS, record


class _Done(Exception):
    pass


def _starts(*args: object, **kwargs: object) -> subprocess.Popen:
    raise _Done  # the launcher got as far as starting its child


def test_demo_data_is_resolved_once_and_named_to_the_ranks(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[int] = []
    real = demo.demo_shard_specs

    def counted() -> tuple[str, str]:
        calls.append(1)
        return real()

    started: list[list[str]] = []

    def popen(cmd: list[str], **kw: object) -> subprocess.Popen:
        started.append(cmd)
        raise _Done

    monkeypatch.setenv("AE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(demo, "demo_shard_specs", counted)
    monkeypatch.setattr(subprocess, "Popen", popen)
    with pytest.raises(_Done):
        main([f"--output_dir={tmp_path / 'run'}", "--devices=2"])
    assert len(calls) == 1  # built/located once per launch, not once per use
    (cmd,) = started
    train, val = real()
    assert f"--train_shards={train}" in cmd and f"--val_shards={val}" in cmd
    assert cmd[cmd.index("-m", 3) + 1] == launch.RANK_MODULE  # the ranks run the package module


def test_own_train_shards_without_val_shards_hand_the_ranks_no_val_spec(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Validation is then held out of the train shards (ae.data.planning.holdout), never the
    demo's."""
    shard = tmp_path / "a.tar"
    shard.write_bytes(b"")
    started: list[list[str]] = []

    def popen(cmd: list[str], **kw: object) -> subprocess.Popen:
        started.append(cmd)
        raise _Done

    monkeypatch.setattr(demo, "demo_shard_specs", lambda: pytest.fail("built the demo data"))
    monkeypatch.setattr(subprocess, "Popen", popen)
    with pytest.raises(_Done):
        main([f"--output_dir={tmp_path / 'run'}", "--devices=2", f"--train_shards={shard}"])
    (cmd,) = started
    assert f"--train_shards={shard}" in cmd
    assert not [a for a in cmd if a.startswith("--val_shards")]


def test_malformed_ae_fault_is_one_message(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("AE_FAULT", "nap@data")
    monkeypatch.setattr(faults, "_faults", faults._UNREAD)
    monkeypatch.setattr(subprocess, "Popen", lambda *a, **k: pytest.fail("started"))
    assert main([f"--output_dir={tmp_path / 'run'}"]) == 2
    err = capsys.readouterr()
    text = err.out + err.err
    assert "AE_FAULT: 'nap@data': expected" in text and "Traceback" not in text


def test_16_mixed_without_a_gpu_is_refused_up_front(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Lightning would run bf16-mixed instead on a CPU while the console says 16-mixed."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # accelerator auto: no GPU visible
    monkeypatch.setattr(subprocess, "Popen", lambda *a, **k: pytest.fail("started"))
    assert main([f"--output_dir={tmp_path / 'run'}", "--precision=16-mixed"]) == 2
    text = "".join(capsys.readouterr())
    assert "precision: 16-mixed needs a GPU" in text and "--precision=32" in text
    assert "--precision=bf16-mixed" in text and "Traceback" not in text


@pytest.mark.parametrize("accelerator", ["auto", "cpu"])
def test_the_gpu_decode_without_a_gpu_is_refused_up_front(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    accelerator: str,
) -> None:
    """Was: the ranks started, built the model, and stopped at the data's setup."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # no GPU visible
    monkeypatch.setattr(subprocess, "Popen", lambda *a, **k: pytest.fail("started"))
    flags = [
        f"--output_dir={tmp_path / 'run'}",
        "--image_decode=gpu",
        f"--accelerator={accelerator}",
    ]
    assert main(flags) == 2
    text = "".join(capsys.readouterr())
    why = "--accelerator=cpu" if accelerator == "cpu" else "no GPU is visible"
    assert (
        f"image_decode: gpu decodes JPEGs on each rank's GPU, and this run has none ({why})" in text
    )
    assert "--image_decode=cpu" in text and "Traceback" not in text


def test_a_missing_fid_weights_file_stops_the_launcher_before_any_rank(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(subprocess, "Popen", lambda *a, **k: pytest.fail("started"))
    missing = tmp_path / "weights" / FID_FILE
    assert main([f"--output_dir={tmp_path / 'run'}", f"--fid_weights={missing}"]) == 2
    text = "".join(capsys.readouterr())
    assert f"fid_weights: no such file: {missing}: rFID needs the FID Inception v3" in text
    assert f"curl -L --create-dirs -o {missing} {FID_URL}" in text and "Traceback" not in text
    assert not (tmp_path / "run").exists()  # stopped before the run folder is claimed


def test_a_stop_signal_that_finds_the_run_finished_is_no_stop(
    tmp_path: Path, said: list[str]
) -> None:
    """The ranks agree on a stop at a vote about a second apart: a SIGUSR1 (SLURM's warning) in
    the run's last second finds it finished, while torchrun, signalled too, exits 1. The job is
    done: exit 0, no requeue, never "preempted before the ranks saved a checkpoint"."""
    cfg = parse_config([f"--output_dir={tmp_path}"])
    logs = cfg.run.dir.logs
    logs.mkdir(parents=True)
    topo = Topology(nnodes=1, node_rank=0, master_addr="127.0.0.1", master_port=None, job="j")
    stops = Stops(first=signal.SIGTERM, requeue=True)
    train_log = logs / TRAIN_LOG_FILE.format(ts=TS)
    train_log.write_text(
        record(
            T0, "INFO", 0, 2, TRAINING_FINISHED.format(step=30, limit=" (--max_steps=30 reached)")
        )
        + "\n"
    )
    assert launch.ending(cfg, topo, TS, 1, stops) is None
    assert said[0] == "The stop signal came as the run ended: training finished at step 30"
    # Not finished: the stop stands (143), said as a stop
    train_log.write_text("")
    assert launch.ending(cfg, topo, TS, 1, stops) == -143
    assert said[-1].startswith("Preempted (SIGTERM) before the ranks saved a checkpoint")


@pytest.mark.parametrize(
    ("nnodes", "where"), [(2, "on another node"), (1, "by a signal to a rank")]
)
def test_a_stop_this_launcher_never_got_is_a_stop(
    tmp_path: Path, said: list[str], nnodes: int, where: str
) -> None:
    """Was: node 1's launcher killed on the same host as node 0 (two "nodes" on one machine):
    every rank saved, node 0's torchrun waited out its exit barrier and ended well, and node 0
    said `Done` and exited 0, though training had stopped at step 21 of 300."""
    cfg = parse_config([f"--output_dir={tmp_path}"])
    logs = cfg.run.dir.logs
    logs.mkdir(parents=True)
    topo = Topology(nnodes=nnodes, node_rank=0, master_addr="127.0.0.1", master_port="1", job="j")
    ckpt = tmp_path / "checkpoints" / "step-00000021.ckpt"
    line = PREEMPTED.format(signal="peer", step=21, path=ckpt, lr="0.001")
    (logs / TRAIN_LOG_FILE.format(ts=TS)).write_text(record(T0, "WARNING", 0, 2, line) + "\n")
    assert launch.ending(cfg, topo, TS, 0, Stops()) == -143
    assert said[-1] == (
        f"Stopped {where}: every rank saved step 21: {ckpt}; "
        "resume with --resume_from_checkpoint=last"
    )


def test_a_tight_limit_is_left_to_the_ranks(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The launcher's reckoning (base sizes: no batch, no model yet) only stops a run; a tight
    limit is said once, by the ranks' reckoning with the measured figures (the two estimates of
    the same memory differed on the console)."""
    tight = Need("host memory", 100 * MB, 90 * MB, "how", "fix")
    monkeypatch.setattr(launch, "launcher_needs", lambda *a: [tight])
    monkeypatch.setattr(subprocess, "Popen", _starts)
    shard = tmp_path / "a.tar"
    shard.write_bytes(b"")
    flags = ["--devices=2", f"--train_shards={shard}"]
    with pytest.raises(_Done):  # it went on to start the ranks
        main([f"--output_dir={tmp_path / 'run'}", *flags])
    text = "".join(capsys.readouterr())
    assert "Training on 2 process(es) per node" in text and "Resource tight" not in text, text
    monkeypatch.setattr(launch, "launcher_needs", lambda *a: [Need("disk", MB, 2 * MB, "h", "f")])
    assert main([f"--output_dir={tmp_path / 'run2'}", *flags]) == 2  # refused: still


@pytest.mark.parametrize(("devices", "noted"), [(3, True), (2, False)])
def test_more_cpu_processes_than_cores_get_a_calm_note(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
    devices: int, noted: bool,
) -> None:  # fmt: skip
    """--devices=3 on a 2-core machine without a GPU: the console says the processes share the
    cores, and how to give each its own; a process per core says nothing."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # no GPU: CPU processes
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    monkeypatch.setattr(subprocess, "Popen", _starts)
    shard = tmp_path / "a.tar"
    shard.write_bytes(b"")
    with pytest.raises(_Done):
        main([f"--output_dir={tmp_path}", f"--devices={devices}", f"--train_shards={shard}"])
    text = "".join(capsys.readouterr())
    note = "Note: 3 processes share this node's 2 CPU cores (no GPU): they take turns on them"
    assert (note in text) == noted, text
    assert ("--devices=2 gives each process its own" in text) == noted


def test_a_follower_that_fails_on_its_own_input_tells_node_0(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Was: node 1 stopped at once (its shards missing there), node 0's torchrun waited for it
    to join for 600 s, saying only after a minute that no rank had started."""
    run_dir = tmp_path / "run"
    for k, v in {"NNODES": "2", "NODE_RANK": "1", "MASTER_ADDR": "127.0.0.1"}.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setattr(launch, "prepare_node", lambda *a, **k: "Network: checked")
    lock = acquire(RunDir(run_dir), "multi-node job at 127.0.0.1:29500", TS)  # node 0's
    missing = tmp_path / "nowhere" / "train-000000.tar"
    try:
        assert main([f"--output_dir={run_dir}", "--devices=1", f"--train_shards={missing}"]) == 2
    finally:
        lock.release()
    said = PeerNodes(run_dir / "logs", TS).refused()
    assert said is not None and said.startswith("Node 1 (host ")
    assert "will not join this job: 1 problem in the configuration:\n  - train_shards:" in said
    assert said.endswith("Stopping here too")


# torchrun's last words when node 1 never came (static rendezvous, as measured with a 20 s join
# timeout on the two-host setup of bench/two_hosts.py)
STORE_TIMED_OUT = """\
        self._store = TCPStore(  # type: ignore[call-arg]
                      ^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^
    torch.distributed.DistStoreError: Timed out after 601 seconds waiting for clients. 1/2 clients joined.
"""  # noqa: E501


def test_a_node_that_never_joined_is_named_with_what_to_do(tmp_path: Path, said: list[str]) -> None:
    """Was: node 0 started alone ended, after torchrun's join timeout, with `Training failed (exit
    1) before any rank wrote a log` and the tail of a torch traceback."""
    cfg = parse_config([f"--output_dir={tmp_path}"])
    logs = cfg.run.dir.logs
    logs.mkdir(parents=True)
    topo = Topology(nnodes=2, node_rank=0, master_addr="10.0.0.1", master_port="29500", job="j")
    (logs / LAUNCHER_LOG_FILE.format(ts=TS)).write_text(STORE_TIMED_OUT)
    assert launch.ending(cfg, topo, TS, 1, Stops()) == -1
    assert said[-1].startswith(
        "No rank started: node 1 never joined this job (torchrun waited 600 s for all 2 nodes "
        "at 10.0.0.1:29500, then gave up). Start the launcher on every node, each with NNODES, "
        "its own NODE_RANK, and the same MASTER_ADDR and MASTER_PORT"
    )
    # the c10d rendezvous (--max_restarts) counts no nodes; of 4, three may be missing
    (logs / LAUNCHER_LOG_FILE.format(ts=TS)).write_text(
        "torch.distributed.elastic.rendezvous.api.RendezvousTimeoutError\n"
    )
    topo = Topology(nnodes=4, node_rank=0, master_addr="10.0.0.1", master_port="29500", job="j")
    assert launch.ending(cfg, topo, TS, 1, Stops()) == -1
    assert said[-1].startswith("No rank started: nodes 1 to 3 never joined this job")
    (logs / LAUNCHER_LOG_FILE.format(ts=TS)).write_text(STORE_TIMED_OUT.replace("1/2", "2/4"))
    assert launch.ending(cfg, topo, TS, 1, Stops()) == -1
    assert said[-1].startswith("No rank started: 2 of nodes 1 to 3 never joined this job")
