"""End-to-end: one run per output folder, Ctrl-C that saves, calm consoles -- the real launcher,
2 gloo ranks on CPU, real tar shards."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
import torch

from ae.job.folder_lock import read_lock
from tests.support.runs import ROOT, SERIAL, run_launcher, run_processes

# SERIAL: a second launch refused and a second Ctrl-C obeyed, each within 5 s
pytestmark = [pytest.mark.slow, SERIAL]

C_LOG_LINE = re.compile(r"^\[?[IWE]\d{4} \d\d:\d\d", re.M)  # c10d/glog: `[I1123 09:47:17...`


@contextlib.contextmanager
def started(out: Path, args: list[str], env: dict[str, str] | None = None) -> Iterator[
    subprocess.Popen[str]
]:  # fmt: skip
    """The launcher in a session of its own, as a terminal's foreground job; killed at the end
    with whatever of its run is left."""
    base = {k: v for k, v in os.environ.items() if k not in ("AE_RUN_TS", "MASTER_PORT")}
    proc = subprocess.Popen(
        [sys.executable, "-m", "ae.cli.launch", f"--output_dir={out}", *args],
        cwd=ROOT, env={**base, "AE_CACHE_DIR": str(out.parent / "cache"), **(env or {})},
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
    )  # fmt: skip
    try:
        yield proc
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        for p in run_processes(out):
            with contextlib.suppress(psutil.Error):
                p.kill()
        proc.communicate(timeout=30)


def wait_for(what: str, check, proc: subprocess.Popen, timeout: float = 180) -> None:
    end = time.monotonic() + timeout
    while not check():
        assert proc.poll() is None, f"the run ended before {what}: {proc.communicate()[0]}"
        assert time.monotonic() < end, f"timed out waiting for {what}"
        time.sleep(0.05)


def step_of(logs: Path, rank: int = 0) -> int:
    steps = [
        int(s)
        for p in logs.glob(f"debug_rank{rank}_*.log")
        for s in re.findall(r"Training step (\d+),", p.read_text(errors="replace"))
    ]
    return max(steps, default=-1)


def ctrl_c(proc: subprocess.Popen) -> None:
    """What a terminal sends on Ctrl-C: SIGINT to the foreground process group."""
    os.killpg(proc.pid, signal.SIGINT)


def test_ctrl_c_saves_and_a_folder_holds_one_run(make_shards, tmp_path: Path) -> None:
    """One 2-rank --debug run, and around it: a second launch into its folder while it runs;
    Ctrl-C mid-epoch; a fresh run over its checkpoints; a launcher killed while holding the lock;
    the resume that continues at the saved step."""
    train = make_shards([40, 40, 30, 20], name="train")  # 8 batches of 8 per rank per epoch
    val = make_shards([24], name="val")
    out = tmp_path / "run"
    logs = out / "logs"
    args = [f"--train_shards={train}", f"--val_shards={val}", "--batch_size=8",
            "--num_workers=1", "--max_epochs=-1", "--warmup_steps=1000",
            "--checkpointing_period=1000", "--debug=true"]  # fmt: skip
    # Steps of 600 ms+: the ranks vote on a stop at every step (a vote about a second apart), so
    # a Ctrl-C early in an epoch stops within it (a stop on an epoch's last step is no cut epoch).
    slow = {"AE_FAULT": "slow@train:ms=600"}
    with started(out, [*args, "--max_steps=5000"], env=slow) as run:
        wait_for("step 10, in epoch 1", lambda: step_of(logs) >= 10, run)
        holder = read_lock(out / "run.lock")
        assert holder is not None and holder.pid == run.pid

        t0 = time.monotonic()
        second = run_launcher([*args, "--max_steps=3"], out)
        assert time.monotonic() - t0 < 5
        assert second.returncode == 2, second.output
        assert f"{out} is in use by another run: local job (pid {run.pid}" in second.output
        assert f"run {holder.run_ts}" in second.output and "Traceback" not in second.output

        wait_for("a step early in an epoch", lambda: step_of(logs) % 8 in (1, 2, 3), run)
        ctrl_c(run)
        output = run.communicate(timeout=120)[0]
    assert run.returncode == 130, output
    m = re.search(
        r"Interrupted at step (\d+); checkpoint saved at (\S+); "
        r"resume with --resume_from_checkpoint=last",
        output,
    )
    assert m, output
    n = int(m[1])
    assert n >= 10 and n % 8 != 0  # mid-epoch (8 optimizer steps per epoch)
    assert "Traceback" not in output and "SignalException" not in output
    assert "Ctrl-C again to stop at once" in output
    for rank in (0, 1):  # every rank saved the same step
        text = "".join(p.read_text() for p in logs.glob(f"debug_rank{rank}_*.log"))
        assert f"PREEMPTED by SIGINT at step {n}: checkpoint" in text, text[-2000:]
        assert f"CHECKPOINT SAVE END ========== step {n} (preemption)" in text
    assert torch.load(out / "checkpoints" / "last.ckpt", weights_only=False)["global_step"] == n
    # The cut epoch says so, with this epoch's values only (no val/ of the epoch before) ...
    cut = re.search(rf"Epoch (\d+) interrupted at batch (\d+) of 8: .*step {n}(.*)", output)
    assert cut and int(cut[2]) == n % 8 and "val/" not in cut[3], output
    assert not cut[3].startswith(";"), cut[0]  # nothing after the step: no stray "; "
    # ... and the stop line came with the phase the signal found, before the save.
    rank0 = "".join(p.read_text() for p in logs.glob("debug_rank0_*.log"))
    stop = re.search(r"Stop signal SIGINT received in phase (.+) at step (\d+)", rank0)
    assert stop and stop[1] != "teardown" and int(stop[2]) <= n, rank0[-2000:]
    assert stop.start() < rank0.index(f"CHECKPOINT SAVE START ========== step {n} (preemption)")
    assert not (out / "run.lock").exists()  # released on exit
    # --debug: c10d's and gloo's own lines went to the native logs, none to the console
    assert not C_LOG_LINE.search(output), output
    native = "".join(p.read_text() for p in logs.glob("native_rank*.log"))
    assert "TCPStore" in native and "[c10d] The debug level is set to INFO" in native
    assert "SignalException" in "".join(p.read_text() for p in logs.glob("launcher_*.log"))

    fresh = run_launcher([*args, "--max_steps=3"], out)
    assert fresh.returncode == 2, fresh.output
    assert "holds checkpoints of an earlier run: best.ckpt, last.ckpt, step-" in fresh.output
    assert "--resume_from_checkpoint=last" in fresh.output and "--overwrite=true" in fresh.output
    assert len(list(logs.glob("train_*.log"))) == 1  # refused before any rank started

    resume = [*args, f"--max_steps={n + 3}", "--resume_from_checkpoint=last"]
    with started(out, resume) as killed:  # SIGKILLed while it holds the lock: a stale lock
        wait_for("the lock", lambda: read_lock(out / "run.lock") is not None, killed)
        stale = read_lock(out / "run.lock")
    assert stale is not None and stale.pid == killed.pid and (out / "run.lock").exists()

    res = run_launcher(resume, out)
    assert res.returncode == 0, res.output
    assert f"Took over {out / 'run.lock'}, left by local job (pid {stale.pid}" in res.output
    main = sorted(logs.glob("train_*.log"))[-1].read_text()
    assert re.search(rf"Resumed from .*last\.ckpt at step {n} \(epoch {n // 8},", main), main
    assert f"Training finished at step {n + 3}" in main
    assert not C_LOG_LINE.search(res.output)


def test_a_second_ctrl_c_stops_at_once(make_shards, tmp_path: Path) -> None:
    """Rank 0 hangs in the checkpoint save that the first Ctrl-C asked for; the second one
    stops every process of the run at once."""
    train = make_shards([40, 40], name="train")
    val = make_shards([8], name="val")
    out = tmp_path / "run"
    args = [f"--train_shards={train}", f"--val_shards={val}", "--batch_size=4",
            "--num_workers=1", "--max_steps=5000", "--max_epochs=-1",
            "--checkpointing_period=1000", "--debug=true"]  # fmt: skip
    with started(out, args, env={"AE_FAULT": "sleep@checkpoint:rank=0:secs=600"}) as run:
        wait_for("step 3", lambda: step_of(out / "logs") >= 3, run)
        ctrl_c(run)
        # rank 0 in the save's sleep (after its bytes, before the rename): its FAULT line, which
        # comes after the save's START line (a fixed second's wait after START before)
        hung = "FAULT injected: sleep@checkpoint"
        wait_for("the save", lambda: hung in "".join(
            p.read_text() for p in (out / "logs").glob("debug_rank0_*.log")
        ), run)  # fmt: skip
        t0 = time.monotonic()
        ctrl_c(run)
        output = run.communicate(timeout=60)[0]
        stopped_in = time.monotonic() - t0
    assert run.returncode == 130, output
    assert stopped_in < 5
    assert "Interrupted: stopped at once (second Ctrl-C)" in output
    assert "Traceback" not in output
    assert not (out / "run.lock").exists()


def test_a_user_error_in_the_ranks_is_one_message(make_shards, tmp_path: Path) -> None:
    """Bad data that only the ranks can see (the val samples do not have the train samples'
    shape): every rank raises the same DataError; the console shows it once; no restart."""
    train = make_shards([16, 16], name="train")
    val = make_shards([8], name="val", dim=5)
    res = run_launcher(
        [f"--train_shards={train}", f"--val_shards={val}", "--batch_size=4", "--num_workers=1",
         "--max_steps=3", "--max_restarts=2"],
        tmp_path / "run",
    )  # fmt: skip
    assert res.returncode == 2, res.output
    assert "Not restarting: a user error" in res.output and "RESTART" not in res.output
    assert len(res.log("train_*.log")) == 1
    lines = [line for line in res.output.splitlines()
             if "val_shards: no readable sample" in line and "expected (16,)" in line]  # fmt: skip
    assert len(lines) == 1, res.output
    assert "Traceback" not in res.output and "ChildFailedError" not in res.output
    assert "Training failed" not in res.output  # a user error, not a failure to diagnose


def test_ctrl_c_during_startup_is_calm(tmp_path: Path) -> None:
    """Ctrl-C while torchrun and the ranks are still starting (importing torch): nothing to
    save, and no KeyboardInterrupt traceback from wherever each process was."""
    out = tmp_path / "run"
    with started(out, ["--max_steps=50"]) as run:
        # a rank's native log exists from its first line, before it imports torch
        wait_for("the ranks", lambda: len(list((out / "logs").glob("native_rank*.log"))) == 2, run)
        time.sleep(0.3)
        ctrl_c(run)
        output = run.communicate(timeout=60)[0]
    assert run.returncode == 130, output
    assert "Interrupted before the ranks saved a checkpoint" in output
    assert "Traceback" not in output and "KeyboardInterrupt" not in output, output
    assert not (out / "run.lock").exists()
