"""End-to-end: the real launcher with a machine limit made real -- a 4 MB /dev/shm, an output
folder on a small tmpfs that another process fills, a low `ulimit -n`, a memory-limited cgroup --
each in a private mount namespace (`unshare -m`, tests/support/limits.py)."""

from __future__ import annotations

import contextlib
import json
import re
import shlex
from pathlib import Path

import psutil
import pytest
import torch

from tests.support.limits import in_namespace, memory_cgroup
from tests.support.runs import LIMITS, run_processes

pytestmark = [pytest.mark.slow, LIMITS]  # /dev/shm and disk filled, a memory cgroup

DIM = 16384  # floats per sample: 64 KB, so a batch of 64 is 4 MB


def test_small_shm_is_refused_and_low_ulimit_refused_or_warned(make_shards, tmp_path: Path) -> None:
    """/dev/shm of 4 MB with 4 MB batches: the ranks' preflight stops the run before the first
    batch, naming the sizes and --shm-size (while `ulimit -n 180` is only tight: a warning);
    `ulimit -n 100` is refused by the launcher before any rank starts."""
    train = make_shards([64, 64], name="train", dim=DIM)
    val = make_shards([64], name="val", dim=DIM)
    out = tmp_path / "run"
    args = shlex.join([f"--output_dir={out}", f"--train_shards={train}", f"--val_shards={val}",
                       "--batch_size=64", "--num_workers=2", "--max_steps=2"])  # fmt: skip
    res = in_namespace(
        f"""
        mount -t tmpfs -o size=4m tmpfs /dev/shm
        (ulimit -n 100; $LAUNCH {args}) > {tmp_path}/refused.txt 2>&1 && exit 9 \
            || echo $? > {tmp_path}/refused.rc
        ulimit -n 180
        $LAUNCH {args} > {tmp_path}/shm.txt 2>&1 || echo $? > {tmp_path}/shm.rc
        """,
        out,
    )
    assert res.returncode == 0, res.stdout + res.stderr
    refused = (tmp_path / "refused.txt").read_text()
    assert (tmp_path / "refused.rc").read_text().strip() == "2", refused
    assert re.search(r"open files \(ulimit -n\): 100 available, the run needs about \d+ ", refused)
    assert "fix: ulimit -n 65536" in refused and "Traceback" not in refused
    assert "Training on" not in refused  # refused by the launcher: no rank started

    shm = (tmp_path / "shm.txt").read_text()
    assert (tmp_path / "shm.rc").read_text().strip() == "2", shm
    assert re.search(r"Resource tight: open files \(ulimit -n\): 180 available, the run needs", shm)
    m = re.search(
        r"shared memory /dev/shm: 4\.0 MB available, the run needs about (\d+\.\d) MB \(batch "
        r"4\.0 MB x prefetch_factor 4 x 2 workers x 2 local ranks, \+25%\); fix: a larger "
        r"/dev/shm \(docker run --shm-size=(\d+)m",
        shm,
    )
    assert m, shm
    assert float(m[1]) == 80.0 and int(m[2]) >= 160
    assert "--batch_size" in shm and "--num_workers" in shm
    assert shm.count("shared memory /dev/shm: 4.0 MB available") == 1, shm  # said once
    assert "Traceback" not in shm
    # refused before the first batch: no step, no checkpoint
    assert not re.search(r"Training step \d", "".join(
        p.read_text() for p in (out / "logs").glob("debug_rank*.log")))  # fmt: skip


def test_disk_full_at_checkpoint_save_is_named_and_resume_continues(
    make_shards, tmp_path: Path
) -> None:
    """The output folder on a 160 MB tmpfs; after the step-2 checkpoint another process fills it
    (leaving 2 MB, less than a checkpoint), so the step-4 save fails with ENOSPC: `disk full` on
    the console and in ae-diagnose --json (rank 0 alone the culprit, of 2 ranks), no partial
    file, last.ckpt still loads (step 2); with the space freed, a resume continues from step 2
    (on 1 rank: a rank fewer to start, and nothing of the resume is about 2)."""
    train = make_shards([160, 160], name="train", dim=1024)
    val = make_shards([32], name="val", dim=1024)
    out, keep = tmp_path / "run", tmp_path / "kept"
    keep.mkdir()
    args = shlex.join([
        f"--output_dir={out}", f"--train_shards={train}", f"--val_shards={val}", "--batch_size=8",
        "--num_workers=1", "--model=mlp", "--checkpointing_period=2",
        "--checkpoints_total_limit=1", "--save_best=false", "--stall_timeout=30",
    ])  # fmt: skip
    res = in_namespace(
        f"""
        mkdir -p {out} && mount -t tmpfs -o size=160m tmpfs {out}
        trap 'cp -r {out}/logs {keep}/logs' EXIT  # the tmpfs goes with the namespace
        # step 3 takes 4 s longer on rank 0: the filler's window between the two saves
        AE_FAULT=slow@train:rank=0:step=3:until=4:ms=4000 $LAUNCH {args} --max_steps=8 \\
            > {keep}/full.txt 2>&1 &
        launcher=$!
        until grep -qs "CHECKPOINT SAVE END ========== step 2" {out}/logs/debug_rank0_*.log; do
            sleep 0.05
        done
        free=$(df -B1 --output=avail {out} | tail -1)
        fallocate -l $((free - 2 * 1024 * 1024)) {out}/filler
        wait $launcher && echo 0 > {keep}/full.rc || echo $? > {keep}/full.rc
        ls -a {out}/checkpoints > {keep}/checkpoints.txt
        $PY -m ae.diagnose {out}/logs --json > {keep}/diagnose.json
        cp {out}/checkpoints/last.ckpt {keep}/last.ckpt  # loaded here, by the test
        rm {out}/filler
        $LAUNCH {args} --max_steps=6 --resume_from_checkpoint=last --devices=1 \\
            > {keep}/resume.txt 2>&1 \\
            && echo 0 > {keep}/resume.rc || echo $? > {keep}/resume.rc
        """,
        out,
    )
    assert res.returncode == 0, res.stdout + res.stderr
    console = (keep / "full.txt").read_text()
    assert (keep / "full.rc").read_text().strip() != "0", console
    assert re.search(
        r"Disk full: no space left on device writing checkpoint \S+step-00000004\.ckpt "
        r"\((\d+ B|\d+\.\d KB|[0-3]\.\d MB) free of 160\.0 MB\)", console,
    ), console  # fmt: skip
    assert re.search(r"Training failed: .*rank 0.*disk full", console), console
    assert "torchrun" not in console.split("Training failed")[-1].split("More:")[0]
    # the partial file is gone, the previous checkpoint stays and loads
    files = (keep / "checkpoints.txt").read_text().split()
    assert not [f for f in files if f.endswith(".tmp")], files
    assert "step-00000002.ckpt" in files and "step-00000004.ckpt" not in files
    assert torch.load(keep / "last.ckpt", weights_only=False)["global_step"] == 2

    doc = json.loads((keep / "diagnose.json").read_text())
    (culprit,) = doc["culprits"]
    assert culprit["rank"] == 0 and culprit["cause"] == "disk full", culprit
    texts = [e["text"] for e in culprit["evidence"]]
    assert any("Disk full: no space left on device" in t for t in texts), texts
    hb = [t for t in texts if t.startswith("heartbeat: output folder disk")]
    assert hb and float(re.search(r"disk (\d+\.\d) MB free", hb[0])[1]) < 4, texts
    rank0 = next(r for r in doc["ranks"] if r["rank"] == 0)
    assert rank0["exit_code"] == 28

    resume = (keep / "resume.txt").read_text()
    assert (keep / "resume.rc").read_text().strip() == "0", resume
    main = sorted((keep / "logs").glob("train_*.log"))[-1].read_text()
    assert re.search(r"Resumed from \S+last\.ckpt at step 2 ", main), main
    assert "Training finished at step 6" in main


def test_worker_killed_for_memory_is_out_of_memory(make_shards, tmp_path: Path) -> None:
    """A real OOM kill: the run in a memory-limited cgroup, rank 1's dataloader worker grows by
    3 GB (AE_FAULT grow); the kernel kills it, and the launcher and ae-diagnose say `out of memory
    (OOM killer)` with the cgroup's OOM-kill count as evidence."""
    found = memory_cgroup()
    if found is None:
        pytest.skip("no writable memory cgroup here; the rule is tested on recorded heartbeats "
                    "in tests/diagnose/test_resources.py")  # fmt: skip
    parent, version = found
    cg = parent / f"ae_oom_{tmp_path.name}"
    limit = "memory.max" if version == "v2" else "memory.limit_in_bytes"
    train = make_shards([80, 80], name="train")
    val = make_shards([16], name="val")
    out = tmp_path / "run"
    args = shlex.join([f"--output_dir={out}", f"--train_shards={train}", f"--val_shards={val}",
                       "--batch_size=8", "--num_workers=1", "--max_steps=12",
                       "--stall_timeout=30"])  # fmt: skip
    res = in_namespace(
        f"""
        mkdir {cg} && echo 2500M > {cg}/{limit}
        echo $$ > {cg}/cgroup.procs
        AE_FAULT=grow@data:rank=1:step=3:mb=3000 $LAUNCH {args} > {tmp_path}/oom.txt 2>&1 \\
            && echo 0 > {tmp_path}/oom.rc || echo $? > {tmp_path}/oom.rc
        echo $$ > {parent}/cgroup.procs
        rmdir {cg}
        $PY -m ae.diagnose {out}/logs --json > {tmp_path}/diagnose.json
        """,
        out,
    )
    assert res.returncode == 0, res.stdout + res.stderr
    console = (tmp_path / "oom.txt").read_text()
    assert (tmp_path / "oom.rc").read_text().strip() != "0", console
    assert re.search(r"Training failed: .*rank 1.*out of memory \(OOM killer\)", console), console
    doc = json.loads((tmp_path / "diagnose.json").read_text())
    (culprit,) = doc["culprits"]
    assert culprit["rank"] == 1 and culprit["cause"] == "out of memory (OOM killer)", culprit
    texts = "\n".join(e["text"] for e in culprit["evidence"])
    # The worker's death as the rank saw it: torch's "killed by signal", or, when the kill came
    # while the rank took a batch's descriptor from it, the pipe's end: EOFError, or
    # ConnectionResetError when the kernel reset the socket first (a race of the two; seen in CI)
    pipe_end = r"exception (EOFError|ConnectionResetError)"
    assert re.search(rf"killed by signal: Killed|{pipe_end}", texts), texts
    assert re.search(r"heartbeat: cgroup OOM kills 0 -> [1-9]", texts), texts


def test_shm_filled_mid_run_fails_the_rank_and_is_named(make_shards, tmp_path: Path) -> None:
    """/dev/shm (100 MB, room for the batches: the preflight passes) filled by another process
    mid-run: a dataloader worker cannot put its next batch in shared memory. That fails in the
    worker's own iteration and the rank raises it -- never a batch silently lost in the queue's
    thread (which left one rank's epoch a batch short and the ranks' collectives mismatched, a
    hang) -- and the console's verdict and ae-diagnose --json name `shared memory exhausted`."""
    train = make_shards([64, 64], name="train", dim=DIM)
    val = make_shards([16], name="val", dim=DIM)
    out = tmp_path / "run"
    logs = out / "logs"
    args = shlex.join([f"--output_dir={out}", f"--train_shards={train}", f"--val_shards={val}",
                       "--batch_size=8", "--num_workers=1", "--max_steps=1000",
                       "--stall_timeout=60"])  # fmt: skip
    try:
        res = in_namespace(
            f"""
            mount -t tmpfs -o size=100m tmpfs /dev/shm
            # step 2 takes 2 s longer on rank 0: the filler's moment, batches still to come
            export AE_FAULT=slow@train:rank=0:step=2:until=3:ms=2000
            $LAUNCH {args} > {tmp_path}/shm.txt 2>&1 &
            launcher=$!
            timeout 150 bash -c 'until grep -qs "FAULT injected" {logs}/debug_rank0_*.log; do
                sleep 0.05; done'
            free=$(df -B1 --output=avail /dev/shm | tail -1)
            fallocate -l $((free - 4096)) /dev/shm/filler
            wait $launcher && echo 0 > {tmp_path}/shm.rc || echo $? > {tmp_path}/shm.rc
            $PY -m ae.diagnose {logs} --json > {tmp_path}/diagnose.json
            """,
            out,
        )
    finally:  # a run left behind by a failed wait: its ranks run in sessions of their own
        for proc in run_processes(out):
            with contextlib.suppress(psutil.Error):
                proc.kill()
    debug = "".join(p.read_text() for p in logs.glob("debug_rank*.log"))
    console = (tmp_path / "shm.txt").read_text() if (tmp_path / "shm.txt").exists() else ""
    assert res.returncode == 0, "\n".join([res.stdout, res.stderr, console, debug[-6000:]])
    assert (tmp_path / "shm.rc").read_text().strip() != "0", console
    assert re.search(r"Training failed: .*rank \d.*shared memory exhausted", console), console
    assert "Traceback" not in console  # the worker's traceback is in the logs, not here
    doc = json.loads((tmp_path / "diagnose.json").read_text())
    assert doc["culprits"], doc
    for culprit in doc["culprits"]:
        assert culprit["cause"] == "shared memory exhausted", culprit
        texts = "\n".join(e["text"] for e in culprit["evidence"])
        assert re.search(r"No space left on device", texts), texts
        assert re.search(r"heartbeat: /dev/shm \d+\.\d MB free of 100\.0 MB", texts), texts
