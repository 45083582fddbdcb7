"""End-to-end on a real SLURM (one node; `slurm` fixture): an `sbatch` job whose script runs
`srun ./train_ae.sh` (the README's recipe: one task per node, torchrun inside) trains until
`scancel` stops it, saving on every rank; then
`srun -N1 -n2` -- one task per process -- trains ONE job of world size 2 from that checkpoint,
until `scancel` stops it as well. And `scancel --signal=USR1` to the same recipe: saved,
requeued, the requeued job resumed by itself and finished, the checkpoints bounded."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.support.runs import ROOT, SLURM
from tests.support.slurm import job_state, wait_for_job_end

# One SLURM cluster for the session (the `slurm` fixture, per xdist worker: two workers would
# start and stop it under each other's jobs).
pytestmark = [pytest.mark.slow, SLURM]


def env() -> dict[str, str]:
    drop = ("AE_RUN_TS", "MASTER_PORT", "MASTER_ADDR")
    # A job's own variables are dropped; SLURM_CONF (a cluster found without /etc/slurm) is not.
    return {
        k: v
        for k, v in os.environ.items()
        if k not in drop and (k == "SLURM_CONF" or not k.startswith("SLURM_"))
    }


def scontrol_show(job_id: str) -> str:
    return subprocess.run(
        ["scontrol", "show", "job", job_id], capture_output=True, text=True, timeout=30
    ).stdout


def step_of(logs: Path) -> int:
    found = [
        int(s)
        for p in logs.glob("debug_rank0_*.log")
        for s in re.findall(r"Training step (\d+),", p.read_text(errors="replace"))
    ]
    return max(found, default=-1)


def test_sbatch_trains_scancel_saves_and_srun_tasks_resume(
    slurm: None, make_shards, tmp_path: Path
) -> None:
    train = make_shards([40, 40, 30, 20], name="train")  # 8 batches of 8 per rank per epoch
    val = make_shards([24], name="val")
    out = tmp_path / "run"
    logs = out / "logs"
    args = [f"--output_dir={out}", f"--train_shards={train}", f"--val_shards={val}",
            "--batch_size=8", "--num_workers=1", "--max_epochs=-1", "--warmup_steps=1000",
            "--checkpointing_period=1000", "--debug=true"]  # fmt: skip
    script = tmp_path / "train.sbatch"
    # The README's recipe: a job step per node running ./train_ae.sh (torchrun inside).
    script.write_text(
        "#!/bin/bash\n#SBATCH --job-name=ae-test --nodes=1 --ntasks-per-node=1\n"
        f"srun ./train_ae.sh {shlex.join(args)} --max_steps=5000\n"
    )
    slurm_out = tmp_path / "slurm.out"
    job = subprocess.run(
        ["sbatch", "--parsable", f"--chdir={ROOT}", f"--output={slurm_out}", str(script)],
        capture_output=True, text=True, timeout=60, env={**env(), "AE_CACHE_DIR": str(tmp_path)},
    )  # fmt: skip
    assert job.returncode == 0, job.stderr
    job_id = job.stdout.strip().split(";")[0]
    try:
        end = time.monotonic() + 240
        while step_of(logs) < 10:
            state = job_state(job_id)
            assert state in ("PENDING", "CONFIGURING", "RUNNING"), (state, slurm_out.read_text())
            assert time.monotonic() < end, "the sbatch job never reached step 10"
            time.sleep(0.2)
    finally:
        subprocess.run(["scancel", job_id], timeout=60)  # SIGTERM to every process of the job
    assert wait_for_job_end(job_id) == "CANCELLED"
    output = slurm_out.read_text()
    assert (
        f"Training on 2 process(es) per node, 4 train shards (SLURM job {job_id} step 0)" in output
    )
    m = re.search(r"Preempted \(SIGTERM\) at step (\d+); checkpoint saved at ", output)
    assert m, output
    n = int(m[1])
    for rank in (0, 1):
        text = "".join(p.read_text() for p in logs.glob(f"debug_rank{rank}_*.log"))
        assert f"PREEMPTED by SIGTERM at step {n}: checkpoint" in text
    assert torch.load(out / "checkpoints" / "last.ckpt", weights_only=False)["global_step"] == n
    assert not (out / "run.lock").exists()
    first_ts = {p.name for p in logs.glob("train_*.log")}

    # Two tasks on the node, one rank each: ONE job of world size 2, resuming at step n; then
    # scancel stops it too (each task's launcher passes SIGTERM to its rank).
    srun = subprocess.Popen(
        ["srun", "-N1", "-n2", "--job-name=ae-test-tasks", f"--chdir={ROOT}", sys.executable,
         "-m", "ae.cli.launch", *args, "--max_steps=5000", "--resume_from_checkpoint=last"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env={**env(), "AE_CACHE_DIR": str(tmp_path)},
    )  # fmt: skip
    try:
        end = time.monotonic() + 240
        while step_of(logs) < n + 4:
            assert srun.poll() is None, srun.communicate()[0]
            assert time.monotonic() < end, "the srun job never reached its 4th step"
            time.sleep(0.2)
        squeue = ["squeue", "-h", "-n", "ae-test-tasks", "-o", "%i"]
        task_job = subprocess.run(squeue, capture_output=True, text=True, timeout=30).stdout
        subprocess.run(["scancel", task_job.strip()], timeout=60)
        output = srun.communicate(timeout=120)[0]
    finally:
        if srun.poll() is None:
            srun.kill()
    assert srun.returncode != 0, output
    assert re.search(rf"Training on one process per SLURM task, .* \(SLURM job {task_job.strip()} "
                     r"step 0\)", output), output  # fmt: skip
    assert output.count("Training on ") == 1  # task 1's launcher leaves the console to task 0
    m = re.search(r"Preempted \(SIGTERM\) at step (\d+); checkpoint saved at ", output)
    assert m and output.count("Preempted") == 1, output
    n2 = int(m[1])
    (train_log,) = [p for p in logs.glob("train_*.log") if p.name not in first_ts]
    ts = train_log.name[len("train_") : -len(".log")]
    assert sorted(p.name for p in logs.glob(f"debug_rank*_{ts}.log")) == [
        f"debug_rank0_{ts}.log",
        f"debug_rank1_{ts}.log",
    ]  # one job: one TS, one log per rank
    main = train_log.read_text()
    assert "Setup: distributed, world size 2 (1 node(s))" in main
    assert re.search(rf"Resumed from .*last\.ckpt at step {n} \(epoch {n // 8},", main), main
    for rank in (0, 1):
        text = (logs / f"debug_rank{rank}_{ts}.log").read_text()
        assert f"[Rank {rank}/2]" in text and f"Training step {n + 1}," in text
        assert f"PREEMPTED by SIGTERM at step {n2}: checkpoint" in text
    assert torch.load(out / "checkpoints" / "last.ckpt", weights_only=False)["global_step"] == n2


def test_usr1_saves_requeues_and_the_requeued_job_resumes_and_finishes(
    slurm: None, make_shards, tmp_path: Path
) -> None:
    """`scancel --signal=USR1` (what `#SBATCH --signal=USR1@90` sends before the time limit) to
    the README's recipe: every rank saves at its next step, the launcher requeues the job, SLURM
    starts the script again and `--resume_from_checkpoint=last` finishes the run, with the
    checkpoints folder bounded by `--checkpoints_total_limit`."""
    train = make_shards([40, 40, 30, 20], name="train")  # 8 batches of 8 per rank per epoch
    val = make_shards([24], name="val")
    out = tmp_path / "run"
    logs = out / "logs"
    args = [f"--output_dir={out}", f"--train_shards={train}", f"--val_shards={val}",
            "--batch_size=8", "--num_workers=1", "--max_steps=30", "--warmup_steps=5",
            "--checkpointing_period=4", "--checkpoints_total_limit=2", "--debug=true",
            "--resume_from_checkpoint=last", "--max_restarts=3"]  # fmt: skip
    script = tmp_path / "train.sbatch"
    script.write_text(
        "#!/bin/bash\n#SBATCH --job-name=ae-requeue --nodes=1 --ntasks-per-node=1 --requeue\n"
        f"srun ./train_ae.sh {shlex.join(args)}\n"
    )
    slurm_out = tmp_path / "slurm.out"
    # Each step slowed, so that the signal lands mid-run; both runs of the job (the requeued
    # one starts the script again, with the environment of the submission).
    job_env = {**env(), "AE_CACHE_DIR": str(tmp_path), "AE_FAULT": "slow@train:ms=150"}
    job = subprocess.run(
        ["sbatch", "--parsable", f"--chdir={ROOT}", f"--output={slurm_out}", "--open-mode=append",
         str(script)],
        capture_output=True, text=True, timeout=60, env=job_env,
    )  # fmt: skip
    assert job.returncode == 0, job.stderr
    job_id = job.stdout.strip().split(";")[0]
    try:
        end = time.monotonic() + 240
        while step_of(logs) < 6:
            state = job_state(job_id)
            assert state in ("PENDING", "CONFIGURING", "RUNNING"), (state, slurm_out.read_text())
            assert time.monotonic() < end, "the sbatch job never reached step 6"
            time.sleep(0.2)
        subprocess.run(["scancel", "--signal=USR1", job_id], timeout=60, check=True)
        # The requeued job starts again once its old credential expires (10 s on the test
        # cluster: `cred_expire` in slurm_cluster.sh, scheduled within a second of it).
        state = wait_for_job_end(job_id, timeout=240)
    finally:
        subprocess.run(["scancel", job_id], timeout=60)
    output = slurm_out.read_text()  # both runs of the job (--open-mode=append)
    assert state == "COMPLETED", (state, output)
    show = scontrol_show(job_id)
    assert "Restarts=1" in show and "ExitCode=0:0" in show, show
    assert "SIGUSR1: every rank saves a checkpoint at its next step, then stops, then the job is " \
        "requeued" in output  # fmt: skip
    m = re.search(r"Preempted \(SIGUSR1\) at step (\d+); checkpoint saved at ", output)
    assert m, output
    n = int(m[1])
    assert 6 <= n < 30
    assert f"Requeued SLURM job {job_id}: it starts again" in output
    # The launcher released the run folder and exited 138, though the requeue SIGTERMs it.
    assert "task 0: Exited with exit code 138" in output, output
    assert "Took over" not in output and not (out / "run.lock").exists()
    assert output.count("Training on 2 process(es) per node") == 2
    first, second = sorted(p.name[len("train_") : -len(".log")] for p in logs.glob("train_*.log"))
    for rank in (0, 1):
        text = (logs / f"debug_rank{rank}_{first}.log").read_text()
        assert f"PREEMPTED by SIGTERM at step {n}: checkpoint" in text
    main = (logs / f"train_{second}.log").read_text()
    # (epoch 1 when the signal lands on the last step of epoch 0, 8 steps an epoch)
    assert re.search(rf"Resumed from .*last\.ckpt at step {n} \(epoch {n // 8},", main), main
    assert "Training finished at step 30" in main
    assert f"Done. Logs: {logs}/ (run {second})" in output
    # Every planned step once: 1..n before the requeue, n+1..30 after it.
    for ts, steps in ((first, range(1, n + 1)), (second, range(n + 1, 31))):
        text = (logs / f"debug_rank0_{ts}.log").read_text()
        assert [int(s) for s in re.findall(r"Training step (\d+),", text)] == list(steps)
    # --checkpoints_total_limit=2 across the requeue: the newest two step files, nothing else.
    ckpts = out / "checkpoints"
    assert sorted(p.name for p in ckpts.glob("step-*.ckpt")) == [
        "step-00000028.ckpt",
        "step-00000030.ckpt",
    ]
    assert torch.load(ckpts / "last.ckpt", weights_only=False)["global_step"] == 30
