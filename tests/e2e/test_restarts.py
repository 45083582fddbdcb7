"""End-to-end self-healing runs (`--max_restarts`): real 2-rank DDP runs (gloo, CPU) broken on
purpose with AE_FAULT (`attempt=0`: only the first attempt), restarted from their newest
checkpoint by the launcher; and the stop rules that end a job instead.

A killed rank and a hung one are 2-rank runs (the other rank is ended with them, the restart
names the rank at fault, the losses match DDP's); the same failure twice and SIGUSR1's requeue
are the launcher's rules, and run 1 rank (a process less a launch: ~5 s of CPU each). Every
rank's save at a stop signal is on 2 ranks in tests/e2e/test_hot_loop.py."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ae.job.restarts import SAME_FAILURE_EXIT, newest_checkpoint
from ae.log_lines import HANG_TIMEOUT, RESTART
from tests.support.runs import ROOT, SERIAL, RunResult, run_launcher

pytestmark = pytest.mark.slow

STEP_LOSS = re.compile(r"\] Training step (\d+), loss=(\S+?)[,\s]")
EPOCH_LOSS = re.compile(r"Epoch (\d+) done: .*train/loss_epoch=([^,\s]+)")


def common(make_shards) -> list[str]:
    train = make_shards([40, 40, 40, 40], name="train")  # 10 batches of 8 per rank per epoch
    val = make_shards([16], name="val")
    return [f"--train_shards={train}", f"--val_shards={val}", "--batch_size=8",
            "--num_workers=1", "--max_epochs=-1", "--max_steps=12", "--checkpointing_period=4",
            "--debug=true", "--log_every_n_train_batches=1"]  # fmt: skip


def step_losses(res: RunResult) -> list[dict[int, str]]:
    """Per attempt (oldest first), rank 0's train loss at each step."""
    out = []
    for log in res.log("debug_rank0_*.log"):  # the TS sorts the attempts
        out.append({int(s): loss for s, loss in STEP_LOSS.findall(log.read_text())})
    return out


def epoch_losses(res: RunResult) -> dict[int, float]:
    """train/loss_epoch of each epoch that finished, from the train logs' epoch lines."""
    text = "".join(log.read_text() for log in res.log("train_*.log"))
    return {int(e): float(v) for e, v in EPOCH_LOSS.findall(text)}


def attempts_json(logs: Path) -> list[dict]:
    res = subprocess.run(
        [sys.executable, "-m", "ae.diagnose", str(logs), "--json"],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout)["attempts"]


@SERIAL  # --stall_timeout=2, --hang_timeout=5: a step slowed by others' load would hang too
def test_a_killed_rank_then_a_hang_past_hang_timeout_restart_the_job_exactly(
    make_shards, tmp_path: Path
) -> None:
    """One job, two failures (one launch: a 2-rank attempt less than a job for each).

    Rank 1 SIGKILLed at step 6 (mid-epoch, attempt 0): the job restarts from step 4's
    checkpoint; the RESTART line names the rank. Then rank 0 sleeps in its training step 10
    (attempt 1): after --hang_timeout it writes its STALL report and exits with its own code,
    and the job restarts again, from step 8's checkpoint. It finishes all 12 steps with the same
    per-step losses as a run without the faults; ae-diagnose lists the attempts with their
    verdicts."""
    args = common(make_shards)
    plain = run_launcher(args, tmp_path / "plain")
    assert plain.returncode == 0, plain.output
    [expected] = step_losses(plain)
    assert sorted(expected) == list(range(1, 13))

    fault = {"AE_FAULT": "kill@train:rank=1:step=6:attempt=0,"
                         "sleep@train:rank=0:step=9:attempt=1:secs=600"}  # fmt: skip
    healed = [*args, "--max_restarts=2", "--stall_timeout=2", "--hang_timeout=5"]
    res = run_launcher(healed, tmp_path / "healed", env=fault)
    assert res.returncode == 0, res.output
    restarts = [line for line in res.output.splitlines() if "RESTART " in line]
    assert len(restarts) == 2, res.output
    first, second, third = step_losses(res)
    assert max(first) < 12 and min(second) == 5 and max(third) == 12
    for step, loss in {**first, **second, **third}.items():  # the later attempts' losses win
        assert expected[step] == loss, (step, expected[step], loss)
    # Epoch 0's mean covers its steps before the restarts too (step 8's checkpoint carries
    # them), the same as the run without the faults' (printed to 5 places: the sums' order
    # differs)
    whole = epoch_losses(plain)
    assert list(whole) == [0] and epoch_losses(res) == pytest.approx(whole, abs=1.5e-5)

    # the kill
    train_logs = res.log("train_*.log")
    assert len(train_logs) == 3
    line = next(m for t in train_logs[1].read_text().splitlines() if (m := RESTART.parse(t)))
    assert line["attempt"] == "1" and line["max"] == "2"
    assert line["failed"].startswith("rank 1") and "killed" in line["failed"], line
    assert line["resume"] == "4" and line["checkpoint"].endswith("step-00000004.ckpt")
    assert int(line["redone"]) == int(line["step"]) - 4 >= 1
    assert train_logs[0].name == f"train_{line['previous']}.log"
    assert "Training finished at step 12" in train_logs[2].read_text()
    assert RESTART.parse(restarts[0]) == line  # the console says what the train log says

    # the hang, in the second attempt
    hung = res.log("debug_rank0_*.log")[1].read_text()
    assert "STALL report" in hung
    hang = next(m for t in hung.splitlines() if (m := HANG_TIMEOUT.parse(t)))
    assert hang["code"] == "124" and hang["phase"] == "training step"
    assert "Rank exiting with code 124: hang timeout" in hung
    assert "RESTART 2/2 after rank 0" in restarts[1] and "hang timeout" in restarts[1]
    assert RESTART.parse(restarts[1])["resume"] == "8"

    attempts = attempts_json(res.logs)
    assert [a["attempt"] for a in attempts] == [0, 1, 2]
    assert attempts[0]["run"] == line["previous"] and attempts[0]["status"] != "finished"
    assert attempts[0]["verdict"].startswith("rank 1") and "killed" in attempts[0]["verdict"]
    assert RESTART.parse(attempts[1]["restart"]) == line
    assert attempts[1]["status"] != "finished" and attempts[1]["verdict"].startswith("rank 0")
    assert attempts[2]["status"] == "finished"


def test_the_same_failure_twice_stops(make_shards, tmp_path: Path) -> None:
    """A deterministic exception at step 5 (1 rank: the rule is the launcher's): the restart
    fails the same way, and the launcher stops there (1 of 5 restarts used) with a code that
    tells a scheduler not to requeue."""
    args = [*common(make_shards), "--max_restarts=5", "--devices=1"]
    res = run_launcher(args, tmp_path / "run", env={"AE_FAULT": "raise@train:rank=0:step=5"})
    assert res.returncode == SAME_FAILURE_EXIT, res.output
    assert len(res.log("train_*.log")) == 2  # two attempts, no more
    assert res.output.count("RESTART 1/5 after rank 0") == 1, res.output
    stop = [line for line in res.output.splitlines() if "not restarting: the same failure" in line]
    assert len(stop) == 1 and "at step 5 twice" in stop[0], res.output
    assert "InjectedFault" in stop[0]
    assert "Training failed: rank 0" in res.output  # and the verdict


def test_sigusr1_saves_requeues_and_the_requeued_job_resumes(make_shards, tmp_path: Path) -> None:
    """What SLURM's `--signal=USR1@90` does to a batch script's launcher (`SLURM_JOB_ID`, no job
    step: one node, torchrun; 1 rank): the rank saves at its next step and stops, the launcher runs
    `scontrol requeue <job>` (a stand-in on PATH records the call here: no SLURM in this test),
    and the job started again with the recipe's `--resume_from_checkpoint=last` resumes there
    and finishes; two step checkpoints at most on disk throughout."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    calls = tmp_path / "scontrol.calls"
    (bin_dir / "scontrol").write_text(f'#!/bin/sh\necho "$@" >> {calls}\n')
    (bin_dir / "scontrol").chmod(0o755)
    out = tmp_path / "run"
    args = [f"--output_dir={out}", *common(make_shards), "--max_steps=60", "--devices=1",
            "--checkpoints_total_limit=2", "--resume_from_checkpoint=last"]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k not in ("AE_RUN_TS", "MASTER_PORT")}
    # Steps of 50 ms+: the ranks agree on a stop at votes about a second apart, well before the
    # end (a stop that finds the run finished is no stop: tests/job/test_launch.py).
    env.update(SLURM_JOB_ID="4242", PATH=f"{bin_dir}:{env['PATH']}",
               AE_CACHE_DIR=str(tmp_path / "cache"), AE_FAULT="slow@train:ms=50")  # fmt: skip
    proc = subprocess.Popen(
        [sys.executable, "-m", "ae.cli.launch", *args], cwd=ROOT, env=env, text=True,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
    )  # fmt: skip
    try:
        end = time.monotonic() + 180
        while not any(
            int(s) >= 6
            for s, _ in STEP_LOSS.findall(
                "".join(p.read_text() for p in (out / "logs").glob("debug_rank0_*.log"))
            )
        ):
            assert proc.poll() is None and time.monotonic() < end, "never reached step 6"
            time.sleep(0.2)
        proc.send_signal(signal.SIGUSR1)
        output = proc.communicate(timeout=120)[0]
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 128 + signal.SIGUSR1, output
    m = re.search(r"Preempted \(SIGUSR1\) at step (\d+); checkpoint saved at ", output)
    assert m, output
    n = int(m[1])
    assert 6 <= n < 60 and calls.read_text() == "requeue 4242\n"
    assert "Requeued SLURM job 4242" in output and "Traceback" not in output
    assert newest_checkpoint(out / "checkpoints") == (n, out / "checkpoints" / f"step-{n:08d}.ckpt")

    res = run_launcher(args[1:], out, env={"SLURM_JOB_ID": "4242", "PATH": env["PATH"]})
    assert res.returncode == 0, res.output
    main = res.log("train_*.log")[-1].read_text()
    assert re.search(rf"Resumed from .*last\.ckpt at step {n} ", main), main
    assert "Training finished at step 60" in main
    assert len(list((out / "checkpoints").glob("step-*.ckpt"))) <= 2
    assert calls.read_text() == "requeue 4242\n"  # a job that finished is not requeued
