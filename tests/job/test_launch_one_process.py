"""One process on one node: the launcher starts the rank itself, with no torchrun between them
(`ae.job.launch.rank_is_child`), and says what torchrun's report would of how it ended."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from ae.cli.launch import main
from ae.config import parse_config
from ae.job import launch, processes
from ae.job.rank_env import LAUNCHER_LOG_ENV, LAUNCHER_PID_ENV
from ae.job.topology import Topology
from ae.log_lines import LAUNCHER_LOG_FILE, RANK_ENDED
from bench.synthetic_logs import TS


class _Started(Exception):
    pass


@pytest.mark.parametrize("devices", [1, 2])
def test_one_process_on_one_node_is_the_launchers_own_child(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
    devices: int,
) -> None:  # fmt: skip
    started: list[tuple[list[str], dict[str, str]]] = []

    def popen(cmd: list[str], env: dict[str, str], **kw: object) -> subprocess.Popen:
        started.append((cmd, env))
        raise _Started

    monkeypatch.setattr(subprocess, "Popen", popen)
    shard = tmp_path / "a.tar"
    shard.write_bytes(b"")
    flags = [f"--devices={devices}", f"--train_shards={shard}"]
    with pytest.raises(_Started):
        main([f"--output_dir={tmp_path / 'run'}", *flags])
    ((cmd, env),) = started
    text = "".join(capsys.readouterr())
    if devices == 2:  # torchrun over the two
        assert cmd[1:3] == ["-m", launch.TORCHRUN_MODULE] and "--nproc_per_node=2" in cmd
        assert LAUNCHER_PID_ENV not in env and "(torchrun's own output)" in text
        return
    assert cmd[:4] == [sys.executable, "-u", "-m", launch.RANK_MODULE]
    assert "--devices=1" in cmd and f"--train_shards={shard}" in cmd
    assert (env["RANK"], env["WORLD_SIZE"], env["LOCAL_RANK"], env["LOCAL_WORLD_SIZE"]) == (
        "0", "1", "0", "1",
    )  # fmt: skip
    assert env["MASTER_ADDR"] and int(env["MASTER_PORT"]) > 0
    # The rank follows this launcher, and notes its death in the attempt's launcher log.
    assert env[LAUNCHER_PID_ENV] == str(os.getpid())
    log = Path(env[LAUNCHER_LOG_ENV])
    assert log.parent == tmp_path / "run" / "logs" and LAUNCHER_LOG_FILE.regex.fullmatch(log.name)
    assert "Training on 1 process(es) per node" in text and "torchrun" not in text, text


KILLED = f"os.kill(os.getpid(), {int(signal.SIGKILL)})"


@pytest.mark.parametrize(("code", "said"), [(KILLED, -signal.SIGKILL), ("sys.exit(124)", 124)])
def test_a_failed_rank_is_recorded_as_torchrun_would_and_the_launcher_exits_1(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, code: str, said: int
) -> None:
    """A rank killed by a signal writes nothing: the launcher, its parent, says how it ended
    (ae-diagnose reads it: tests/diagnose/test_launcher_log.py), and ends as with torchrun."""
    cfg = parse_config([f"--output_dir={tmp_path}", "--devices=1"])
    cfg.run.dir.logs.mkdir(parents=True)  # as `launch.attempts` makes it
    topo = Topology(nnodes=1, node_rank=0, master_addr="127.0.0.1", master_port=None, job="j")
    rank = [sys.executable, "-c", f"import os, sys; {code}"]
    monkeypatch.setattr(launch, "child_command", lambda *a: (rank, dict(os.environ)))
    rc, stops, _ = launch.attempt(cfg, topo, 1, TS, [], ["a.tar", None], None, 0, 1)
    assert rc == 1 and stops.first is None
    log = (cfg.run.dir.logs / LAUNCHER_LOG_FILE.format(ts=TS)).read_text()
    m = RANK_ENDED.parse(log)
    assert m is not None and (m["rank"], m["code"]) == ("0", str(said)), log


def test_ae_encodes_one_process_is_its_launchers_own_child_too(tmp_path: Path) -> None:
    """ae-encode's launcher shares the rule (`processes.run_ranks`): one process on one node is
    started without torchrun, with torchrun's variables, and a failed one is recorded."""
    topo = Topology(nnodes=1, node_rank=0, master_addr="127.0.0.1", master_port=None, job="j")
    log = tmp_path / "logs" / LAUNCHER_LOG_FILE.format(ts=TS)
    seen = tmp_path / "env.txt"
    code = f"import os; open({str(seen)!r}, 'w').write(os.environ['WORLD_SIZE']); os._exit(3)"
    # `python -u -m MODULE ARGS`: a module that runs `code`, where the rank module would be
    (tmp_path / "fake_rank.py").write_text(code)
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    rc, stopped = processes.run_ranks(
        "fake_rank", False, [], nproc=1, topo=topo, env=env, launcher_log=log
    )
    assert (rc, stopped) == (1, None) and seen.read_text() == "1"
    m = RANK_ENDED.parse(log.read_text())
    assert m is not None and m["code"] == "3", log.read_text()
