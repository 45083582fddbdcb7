"""A launcher killed from outside -- SIGKILL to its process group, the SIGHUP of a closed terminal
-- takes its job with it: torchrun follows it (PR_SET_PDEATHSIG), or the one rank it started
itself does (one process on one node), the ranks save and stop, and the folder stays locked
until the last of them is gone, so no second job starts beside them.

One launch per case. Every rank sleeps 8 s in training step 3 (`AE_FAULT`); the launcher is
killed in that sleep, so the job's processes are known to live while a second launch tries the
folder (6 s measured no faster: kept at 8, the margin of that race). With two nodes, node 1's
launcher is the one killed: node 0 ends with a verdict; no second launch races the sleep there,
so it is 3 s, the kill's moment (and the job's processes known) and no more. The two kills'
two-node jobs run at once, each on its own pair of hosts (the second one's kill may land just
after its sleep, mid-training: the same case).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from ae.data.decoding.decode import InputSpec
from ae.job.restarts import newest_checkpoint
from ae.log_lines import LAUNCHER_GONE, RANK_LAUNCHER_GONE
from bench.two_hosts import TwoHosts, available, cleanup_stale
from tests.support.encode_checkpoint import encode_checkpoint
from tests.support.live import wait_for
from tests.support.runs import ROOT, TWO_HOSTS, run_processes
from tests.support.shards import write_test_shards

pytestmark = [
    pytest.mark.slow,
    TWO_HOSTS,
]  # network namespaces; a second launch refused while the job lives

SLEEP = "sleep@train:step=3:secs=8"  # every rank, in its step 3: the launcher dies meanwhile
SLEEP_TWO_NODES = "sleep@train:step=3:secs=3"  # no second launch to race it there
KILLS = [signal.SIGKILL, signal.SIGHUP]
# On one node, each kill once: torchrun over 2 ranks; the one rank that the launcher starts itself
ONE_NODE_KILLS = [(signal.SIGKILL, 2), (signal.SIGHUP, 1)]


def _sighup_as_from_a_terminal() -> None:
    """A launcher started from a terminal dies of its SIGHUP. The suite itself may run under
    `nohup`, whose ignored SIGHUP every child inherits (and the launcher then rightly lives on):
    the launchers here start with SIGHUP's default, as from a terminal."""
    signal.signal(signal.SIGHUP, signal.SIG_DFL)


def shard_args(make_shards) -> list[str]:
    train = make_shards([200, 200], name="train")
    val = make_shards([16], name="val")
    return [f"--train_shards={train}", f"--val_shards={val}", "--batch_size=8", "--max_epochs=50",
            "--num_workers=1", "--checkpointing_period=2"]  # fmt: skip


def base_env(tmp_path: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("AE_RUN_TS", "MASTER_PORT")}
    return {**env, "AE_CACHE_DIR": str(tmp_path / "cache"), "AE_FAULT": SLEEP}


def fault_fired(logs: Path, ranks: int) -> bool:
    found = [p for p in logs.glob("debug_rank*_*.log") if "FAULT injected" in p.read_text()]
    return len(found) == ranks


def second_launch(out: Path, env: dict[str, str]) -> subprocess.CompletedProcess:
    """The user starts again into the same folder, resuming: refused while the job lives. Its
    shard spec names nothing, so a launch that got the folder ends there (exit 2) untrained."""
    argv = [sys.executable, "-m", "ae.cli.launch", f"--output_dir={out}",
            "--resume_from_checkpoint=last", f"--train_shards={out}/none-{{0..1}}.tar"]  # fmt: skip
    return subprocess.run(
        argv, cwd=ROOT, env={**env, "AE_FAULT": ""}, capture_output=True, text=True, timeout=120
    )


def all_gone(out: Path, family: list[psutil.Process], timeout: float = 90) -> None:
    """Every process of the job ends: those seen before the kill, and any naming the folder."""
    _, alive = psutil.wait_procs(family, timeout=timeout)
    assert not alive, [p.pid for p in alive]
    wait_for("no process naming the run folder", lambda: not run_processes(out), timeout=30)


def job_family(launcher: int) -> list[psutil.Process]:
    """The launcher's descendants: torchrun, the ranks, their dataloader workers."""
    return psutil.Process(launcher).children(recursive=True)


def run_timestamps(logs: Path) -> set[str]:
    return {
        m[1] for p in logs.glob("debug_rank*.log") if (m := re.search(r"_(\d{8}_\d{6})", p.name))
    }


@pytest.mark.parametrize(
    ("sig", "ranks"), ONE_NODE_KILLS, ids=lambda k: getattr(k, "name", f"{k}rank")
)
def test_one_node_job_follows_its_killed_launcher(
    tmp_path: Path, make_shards, sig: signal.Signals, ranks: int
) -> None:
    out, env = tmp_path / "run", base_env(tmp_path)
    logs = out / "logs"
    console = (tmp_path / "console.txt").open("w")
    launcher = subprocess.Popen(
        [sys.executable, "-m", "ae.cli.launch", f"--output_dir={out}", *shard_args(make_shards),
         f"--devices={ranks}"],
        cwd=ROOT, env=env, stdout=console, stderr=subprocess.STDOUT, start_new_session=True,
        preexec_fn=_sighup_as_from_a_terminal,
    )  # fmt: skip
    try:
        wait_for("every rank in its sleeping step", lambda: fault_fired(logs, ranks), timeout=180)
        family = job_family(launcher.pid)
        # torchrun and two ranks, or the one rank (and their dataloader workers)
        assert len(family) >= (1 if ranks == 2 else 0) + ranks, family
        names = " ".join(" ".join(p.cmdline()) for p in family)
        assert ("ae.job.torchrun" in names) == (ranks == 2), names
        os.killpg(launcher.pid, sig)
        assert launcher.wait(timeout=10) == -sig
        second = second_launch(out, env)
        all_gone(out, family)
    finally:
        for p in run_processes(out):
            p.kill()
    said = second.stdout + second.stderr
    assert second.returncode == 2, said
    assert "is in use by another run" in said and "its launcher is gone" in said, said
    assert run_timestamps(logs) and len(run_timestamps(logs)) == 1  # no second job's logs
    train_log = next(logs.glob("train_*.log")).read_text()
    assert "Stop signal SIGTERM received" in train_log
    assert re.search(r"PREEMPTED by SIGTERM at step \d+: checkpoint \S+ saved", train_log)
    # The launcher log says where that SIGTERM came from: torchrun's wrapper, or the rank, saw
    # itself reparented; and so does ae-diagnose's verdict.
    (launcher_log,) = logs.glob("launcher_*.log")
    gone = LAUNCHER_GONE.format(pid=launcher.pid) if ranks == 2 else (
        RANK_LAUNCHER_GONE.format(pid=launcher.pid, rank=0))  # fmt: skip
    assert gone in launcher_log.read_text()
    diagnosis = subprocess.run(
        [sys.executable, "-m", "ae.diagnose", str(logs), "--json"], cwd=ROOT, capture_output=True,
        text=True, timeout=60,
    )  # fmt: skip
    stopped = json.loads(diagnosis.stdout)["stopped_by"]
    assert stopped["signal"] == "SIGTERM" and stopped["launcher_gone"] == launcher.pid, stopped
    # All gone, the folder is free: the next launch takes the lock file over.
    third = second_launch(out, env)
    assert "Took over" in third.stdout + third.stderr, third.stdout + third.stderr


def test_ae_encode_follows_its_killed_launcher(tmp_path: Path, make_shards) -> None:
    """ae-encode's torchrun follows its launcher too: SIGKILLed while every rank sleeps (10
    minutes) on its first batch, the launcher takes its ranks with it, and torchrun's own words
    are in the launcher log, not on the console."""
    spec = InputSpec("vector", (16,))
    ckpt = encode_checkpoint(tmp_path, spec)
    shards, out = make_shards([20, 20]), tmp_path / "latents"
    env = {**base_env(tmp_path), "AE_FAULT": "sleep@data:step=0:secs=600"}
    console = (tmp_path / "console.txt").open("w")
    launcher = subprocess.Popen(
        [sys.executable, "-m", "ae.cli.encode", str(ckpt), shards, str(out), "--devices=2"],
        cwd=ROOT, env=env, stdout=console, stderr=subprocess.STDOUT, start_new_session=True,
    )  # fmt: skip
    logs = out / "logs"
    try:
        wait_for("every rank in its sleeping batch", lambda: fault_fired(logs, 2), timeout=180)
        second = subprocess.run(
            [sys.executable, "-m", "ae.cli.encode", str(ckpt), shards, str(out), "--overwrite"],
            cwd=ROOT, env=env, capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert second.returncode == 2, second.stdout + second.stderr
        busy = f"is in use by another run: ae-encode, local job (pid {launcher.pid} "
        assert busy in second.stderr, second.stderr  # one job per OUT_DIR, even with --overwrite
        family = job_family(launcher.pid)
        assert len(family) >= 3, family  # torchrun and two ranks
        os.killpg(launcher.pid, signal.SIGKILL)
        assert launcher.wait(timeout=10) == -signal.SIGKILL
        _, alive = psutil.wait_procs(family, timeout=60)  # not the ranks' 600 s sleep
        assert not alive, [p.cmdline() for p in alive]
    finally:
        for p in run_processes(out):
            p.kill()
    (launcher_log,) = logs.glob("launcher_*.log")
    assert "torch.distributed" in launcher_log.read_text()  # torchrun's own, in its file
    said = (tmp_path / "console.txt").read_text()
    assert f"launcher  : {launcher_log}" in said, said


@pytest.fixture(scope="module")
def two_hosts_possible() -> None:
    ok, why = available()
    if not ok:
        pytest.skip(f"two hosts: {why}")
    cleanup_stale()


def _start_two_nodes(tmp: Path, hosts: TwoHosts, port: int) -> tuple[Path, list[subprocess.Popen]]:
    """Both nodes' launchers, each in a session of its own as from a terminal."""
    train = write_test_shards(tmp / "shards", [200, 200], name="train")
    val = write_test_shards(tmp / "shards", [16], name="val")
    out = tmp / "run"
    args = [f"--output_dir={out}", f"--train_shards={train}", f"--val_shards={val}",
            "--batch_size=8", "--max_epochs=50", "--num_workers=1", "--checkpointing_period=2",
            "--devices=1"]  # fmt: skip
    nodes = []
    for node in (0, 1):
        env = {**base_env(tmp), "NNODES": "2", "NODE_RANK": str(node),
               "MASTER_ADDR": hosts.addrs[0], "MASTER_PORT": str(port),
               "AE_FAULT": SLEEP_TWO_NODES}  # fmt: skip
        env = {k: v for k, v in env.items() if not k.endswith("_SOCKET_IFNAME")}
        sink = (tmp / f"console_node{node}.txt").open("w")
        nodes.append(hosts.popen(node, [sys.executable, "-m", "ae.cli.launch", *args],
                                 env=env, cwd=ROOT, stdout=sink, stderr=subprocess.STDOUT,
                                 start_new_session=True,
                                 preexec_fn=_sighup_as_from_a_terminal))  # fmt: skip
    return out, nodes


@pytest.fixture(scope="module")
def node_1_killed(tmp_path_factory: pytest.TempPathFactory, two_hosts_possible) -> dict:
    """Both kills' two-node jobs at once, each on its own pair of hosts: node 1's launcher killed
    (SIGKILL in one, SIGHUP in the other) while every rank sleeps in its step 3; each job's node 0
    awaited. Per signal: node 0's exit code, how long after the kill it ended, its folder."""
    found: dict = {}
    with contextlib.ExitStack() as stack:
        jobs = {}
        for sig in KILLS:
            tmp = tmp_path_factory.mktemp(f"node_1_{sig.name}")
            hosts = stack.enter_context(TwoHosts())
            jobs[sig] = (tmp, *_start_two_nodes(tmp, hosts, 29620 + KILLS.index(sig)))
        for sig, (tmp, out, (node0, node1)) in jobs.items():
            wait_for(f"every rank in its sleeping step ({sig.name})",
                     lambda out=out: fault_fired(out / "logs", 2), timeout=180)  # fmt: skip
            family = job_family(node0.pid) + job_family(node1.pid)
            killed_at = time.monotonic()
            os.killpg(node1.pid, sig)
            assert node1.wait(timeout=10) == -sig
            found[sig] = {"tmp": tmp, "out": out, "family": family, "killed_at": killed_at}
        pending = {sig: node0 for sig, (_, _, (node0, _)) in jobs.items()}
        deadline = time.monotonic() + 120
        while pending:  # each node 0's end, timed as it comes
            for sig, node0 in list(pending.items()):
                if (code := node0.poll()) is not None:
                    found[sig] |= {"code": code, "took": time.monotonic() - found[sig]["killed_at"]}
                    del pending[sig]
            assert time.monotonic() < deadline, f"node 0 still running 120 s after: {pending}"
            time.sleep(0.1)
        for job in found.values():
            all_gone(job["out"], job["family"])
    return found


@pytest.mark.parametrize("sig", KILLS, ids=lambda s: s.name)
def test_node_1s_killed_launcher_ends_the_job_with_a_verdict_on_node_0(
    node_1_killed: dict, sig
) -> None:
    job = node_1_killed[sig]
    out, code, took = job["out"], job["code"], job["took"]
    logs = out / "logs"
    text = (job["tmp"] / "console_node0.txt").read_text()
    assert code == 128 + signal.SIGTERM, text  # a stop: every rank saved
    assert took < 60, (took, text)  # not torchrun's 300 s exit barrier
    assert "Traceback" not in text, text
    # The stop's save is last.ckpt when it falls on a periodic save's step, else its own file
    # (under load the ranks' vote can land between two periodic saves).
    m = re.search(
        r"Stopped on another node: rank 1 on node1 \(SIGTERM\) got a stop signal .*; every rank "
        r"saved step (\d+): (\S+\.ckpt); resume with --resume_from_checkpoint=last",
        text,
    )
    assert m, "\n".join(text.splitlines()[-12:])  # the end: what a CI report's excerpt shows
    step, saved = int(m[1]), Path(m[2])
    assert saved.name in ("last.ckpt", f"step-{step:08d}.ckpt") and saved.is_file()
    assert newest_checkpoint(out / "checkpoints")[0] == step
    assert len(run_timestamps(logs)) == 1
