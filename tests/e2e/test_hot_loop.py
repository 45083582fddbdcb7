"""The hot loop of a 2-rank run, and its stop and resume, from one launch stopped by SIGTERM (as
`docker stop` sends it) in its second epoch: between two optimizer steps of an epoch the training
process group carries DDP's gradient all-reduces and Lightning's own per-batch signal broadcast,
and nothing of ours, on that group or any other (counted from the Flight Recorder dumps the ranks
write when stopped): the stop vote goes through the job's c10d store; the signal saves the same
step on every rank, within the documented time, and exits 0 on every rank;
`--resume_from_checkpoint=last` continues that step, LR and epoch (the one resume launch of the
module)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import pytest
import torch
import yaml

from ae.data.shards.writer import write_shard
from ae.diagnose.log_files import find_run
from ae.diagnose.report import diagnose
from ae.training.step_vote import VOTE_EVERY_S
from tests.support.runs import ROOT, run_launcher, shared_launches
from tests.support.shards import vector_samples

pytestmark = [pytest.mark.slow, shared_launches(__name__)]

PER_EPOCH = 100  # batches of 8 a rank an epoch: 4 shards of 400 vectors over 2 ranks
STOP_AT_LEAST = PER_EPOCH + 40  # steps trained before the signal: 40 or more into epoch 1
_TIME = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d{3}) ")


@dataclass
class Stopped:
    returncode: int
    output: str
    logs: Path
    signalled_at: float  # time.time() when the launcher got SIGTERM
    args: list[str]  # its flags but --output_dir and --max_steps, for the resume
    files: list[Path]  # its log files (the resume adds its own beside them)

    def own(self, pattern: str) -> list[Path]:
        return [p for p in self.files if p.match(pattern)]


ARGS = ["--batch_size=8", "--num_workers=1", "--max_epochs=-1", "--learning_rate=1e-3",
        "--lr_scale=linear", "--warmup_steps=1000", "--lr_scheduler=constant",
        "--checkpointing_period=1000", "--debug=true"]  # fmt: skip


@pytest.fixture(scope="module")
def stopped(tmp_path_factory: pytest.TempPathFactory) -> Stopped:
    """A 2-rank CPU run (epochs of PER_EPOCH steps, each validated; no checkpoint before the
    stop), sent SIGTERM after STOP_AT_LEAST steps. A long warmup makes the LR a function of the
    step alone, so the resume may stop earlier than the first run would have and still must
    follow the same schedule."""
    tmp = tmp_path_factory.mktemp("hot_loop")
    for i in range(4):
        write_shard(tmp / f"train-{i:06d}.tar", vector_samples(400, 16, 400 * i))
    write_shard(tmp / "val-000000.tar", vector_samples(32, 16, 10_000))
    out = tmp / "run"
    args = [f"--output_dir={out}", f"--train_shards={tmp}/train-{{000000..000003}}.tar",
            f"--val_shards={tmp}/val-000000.tar", *ARGS]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k not in ("AE_RUN_TS", "MASTER_PORT")}
    env["AE_CACHE_DIR"] = str(tmp / "cache")
    proc = subprocess.Popen(
        [sys.executable, "-m", "ae.cli.launch", *args, "--max_steps=2000"], cwd=ROOT, env=env,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    try:
        _wait_for_step(out / "logs", STOP_AT_LEAST, proc, timeout=240)
        signalled_at = time.time()
        proc.send_signal(signal.SIGTERM)
        output = proc.communicate(timeout=120)[0]
    finally:
        if proc.poll() is None:
            proc.kill()
    logs = out / "logs"
    return Stopped(proc.returncode, output, logs, signalled_at, args[1:], sorted(logs.iterdir()))


def _wait_for_step(logs: Path, at_least: int, proc: subprocess.Popen, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        for path in logs.glob("debug_rank0_*.log"):
            steps = re.findall(r"Training step (\d+),", path.read_text(errors="replace"))
            if steps and int(steps[-1]) >= at_least:
                return
        time.sleep(0.05)
    raise AssertionError(f"training never reached step {at_least}")


def _debug_log(stopped: Stopped, rank: int) -> str:
    return "".join(p.read_text() for p in stopped.own(f"debug_rank{rank}_*.log"))


def _preempted_step(stopped: Stopped) -> int:
    m = re.search(r"Preempted \(SIGTERM\) at step (\d+); checkpoint saved at ", stopped.output)
    assert m, stopped.output[-3000:]
    return int(m.group(1))


def test_sigterm_saves_the_same_step_on_every_rank(stopped: Stopped) -> None:
    assert stopped.returncode == 143, stopped.output[-3000:]
    n = _preempted_step(stopped)
    assert n >= STOP_AT_LEAST
    for rank in (0, 1):
        text = _debug_log(stopped, rank)
        assert f"PREEMPTED by SIGTERM at step {n}: checkpoint" in text, text[-2000:]
        assert f"CHECKPOINT SAVE END ========== step {n} (preemption)" in text
        assert "Rank exiting with code 0: preempted" in text


def _line_time(line: str) -> float:
    m = _TIME.match(line)
    assert m, line
    return datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S.%f").timestamp()


def test_from_the_signal_to_the_save_within_the_documented_time(stopped: Stopped) -> None:
    """docs/RUNS.md: at most the time to the next vote (VOTE_EVERY_S, or one step if longer)
    plus one step, then the save. Steps here take milliseconds; the slack is for the launcher
    and torchrun passing the signal on, and a loaded machine."""
    n = _preempted_step(stopped)
    text = _debug_log(stopped, 0)
    signalled = re.search(r"Stop signal SIGTERM received in phase .+ at step (\d+)", text)
    assert signalled, text[-2000:]
    assert int(signalled.group(1)) <= n
    (end,) = [ln for ln in text.splitlines() if f"SAVE START ========== step {n} " in ln]
    assert _line_time(end) - stopped.signalled_at < VOTE_EVERY_S + 4.0


@dataclass(frozen=True)
class Entry:
    pg: str
    op: str
    created_ns: int
    frames: list[tuple[str, str]]  # (file, function), innermost first

    def issued_by_ae_within_lightning(self) -> bool:
        """An ae frame inside Lightning's loop (a callback, a hook, a training step of ours)
        issued it, rather than Lightning or DDP under the fit that ae's rank calls."""
        ae = [i for i, (f, _) in enumerate(self.frames) if "/ae/" in f]
        lightning = [i for i, (f, _) in enumerate(self.frames) if "/lightning/" in f]
        return bool(ae and lightning) and min(ae) < max(lightning)

    def ddp_gradients(self) -> bool:
        return self.op == "all_reduce" and any(fn == "backward" for _, fn in self.frames)

    def ddp(self) -> bool:
        """DDP's: its gradient all-reduces, and what its forward issues (after the first step
        it rebuilds its buckets and broadcasts their order, once)."""
        return self.ddp_gradients() or any(
            f.endswith("torch/nn/parallel/distributed.py") for f, _ in self.frames
        )

    def lightning_signal_broadcast(self) -> bool:
        return self.op == "broadcast" and any(
            fn == "_broadcast_sigterm_tensor" for _, fn in self.frames
        )


def _entries(stopped: Stopped, rank: int) -> list[Entry]:
    (path,) = stopped.own(f"collectives_rank{rank}_*.json")
    doc = json.loads(path.read_text())
    assert doc["reason"] == "stopped: SIGTERM"
    return [
        Entry(str(e["pg_id"]), str(e["profiling_name"]).rsplit(":", 1)[-1],
              int(e["time_created_ns"]),
              [(str(f["filename"]).replace("\\", "/"), str(f["name"])) for f in e["frames"]])
        for e in doc["entries"] if not e.get("is_p2p")
    ]  # fmt: skip


def training_windows(entries: list[Entry], steps: int) -> tuple[str, list[list[Entry]]]:
    """The training group and, epoch by epoch, its entries from the epoch's first gradient
    all-reduce to its last one (the steps of epoch 0, then those of epoch 1 before the stop; the
    epoch's end, its validation, and the stop's save come between or after). One all-reduce a
    step, every one of the run's `steps` on record (the ring buffer never wrapped), so each
    PER_EPOCH-th is an epoch's first."""
    training = next(e.pg for e in entries if e.ddp_gradients())
    own = [e for e in entries if e.pg == training]
    grads = [i for i, e in enumerate(own) if e.ddp_gradients()]
    assert abs(len(grads) - steps) <= 1, (len(grads), steps)
    epochs = [grads[i : i + PER_EPOCH] for i in range(0, len(grads), PER_EPOCH)]
    return training, [own[g[0] : g[-1] + 1] for g in epochs]


@pytest.mark.parametrize("rank", [0, 1])
def test_a_training_step_has_ddps_collectives_and_none_of_ours(stopped: Stopped, rank: int) -> None:
    """Between two steps: DDP's gradient all-reduce and Lightning's broadcast of its own
    SIGTERM flag (every batch, also in bare Lightning), nothing issued by ae; the put-back
    per-step stop all-reduce (or any per-step collective of ours) fails this."""
    entries = _entries(stopped, rank)
    training, windows = training_windows(entries, _preempted_step(stopped))
    for window in windows:
        _no_collective_of_ours(entries, training, window)


def _no_collective_of_ours(entries: list[Entry], training: str, window: list[Entry]) -> None:
    grads = [e for e in window if e.ddp_gradients()]
    assert len(grads) >= 30, f"only {len(grads)} steps on record"
    others = [e for e in window if not (e.ddp() or e.lightning_signal_broadcast())]
    ours = [e for e in others if e.issued_by_ae_within_lightning()]
    assert ours == [], [(e.op, e.frames[:6]) for e in ours[:3]]
    assert others == [], [(e.op, e.frames[:6]) for e in others[:3]]
    # one broadcast a batch (no gradient accumulation here: a batch is a step)
    broadcasts = sum(e.lightning_signal_broadcast() for e in window)
    assert abs(broadcasts - len(grads)) <= 1

    # Nor on any group of its own: the stop vote goes through the job's c10d store, not a
    # collective (the stop it carries is the SIGTERM tests' own).
    start, end = window[0].created_ns, window[-1].created_ns
    elsewhere = [e for e in entries if e.pg != training and start <= e.created_ns <= end]
    assert elsewhere == [], [(e.pg, e.op, e.frames[:6]) for e in elsewhere[:3]]


def _lrs(text: str) -> dict[int, float]:
    """{step: lr} from the `Training step K, loss=X, lr=Y` lines of a --debug rank log."""
    return {
        int(s): float(v) for s, v in re.findall(r"Training step (\d+), loss=\S+, lr=([^,]+)", text)
    }


def test_sigterm_saves_on_every_rank_and_resume_continues(stopped: Stopped) -> None:
    """SIGTERM to the launcher -> every rank saves the same step checkpoint and exits 0;
    `--resume_from_checkpoint=last` continues that step, LR and epoch (epoch 1, mid-epoch)."""
    assert stopped.returncode == 143, stopped.output  # documented: 128 + SIGTERM
    n = _preempted_step(stopped)
    lrs_before = set()
    for rank in (0, 1):
        text = _debug_log(stopped, rank)
        pre = re.search(rf"PREEMPTED by SIGTERM at step {n}: checkpoint .* \(LR (\S+)\)", text)
        assert pre, text[-3000:]
        lrs_before.add(pre.group(1))
        assert f"CHECKPOINT SAVE END ========== step {n} (preemption)" in text
        assert "Rank exiting with code 0: preempted" in text
    (lr_before,) = lrs_before  # both ranks hold the same LR
    out = stopped.logs.parent
    last = torch.load(out / "checkpoints" / "last.ckpt", weights_only=False)
    assert last["global_step"] == n
    # The epoch's loss sum so far, both ranks' (reduced at the save), for the resumed epoch's
    # train/loss_epoch: every batch of it (all PER_EPOCH when the signal came at its last step)
    carried = last["ae_epoch_loss"]
    assert carried["count"] == 2 * (n % PER_EPOCH or PER_EPOCH) and carried["total"] > 0, carried
    verdict = diagnose(find_run(stopped.logs))  # saved and exited 0, but not done training
    assert verdict["status"] == "stopped" and verdict["stopped_by"]["step"] == n, verdict

    res = run_launcher(
        [*stopped.args, f"--max_steps={n + 6}", "--resume_from_checkpoint=last"], out, env=None
    )
    assert res.returncode == 0, res.output
    logs = sorted(res.logs.glob("train_*.log"))
    assert len(logs) == 2
    main = logs[-1].read_text()
    epoch, batch = divmod(n, PER_EPOCH)
    resumed = re.search(rf"Resumed from .*last\.ckpt at step {n} \(epoch \d+, LR (\S+)\)", main)
    assert resumed and resumed.group(1) == lr_before, main
    assert f"Training finished at step {n + 6}" in main
    rank0 = sorted(res.logs.glob("debug_rank0_*.log"))[-1].read_text()
    if batch:  # mid-epoch: the rest of that epoch
        assert f"Resuming the train data at epoch {epoch}, batch {batch} of {PER_EPOCH}" in rank0
        assert re.search(
            rf"EPOCH {epoch} TRAINING START ========== \(resumed at batch {batch}\)", rank0
        )
    else:  # the signal came at an epoch's last step: the next epoch starts whole
        assert re.search(rf"EPOCH {epoch} TRAINING START ==========\s*$", rank0, re.M), rank0
        assert "resumed at batch" not in rank0
    # The heartbeat (ae-diagnose's epoch column) names the epoch the run ended in, a resumed
    # epoch's too (step s is batch (s - 1) % PER_EPOCH of epoch (s - 1) // PER_EPOCH)
    beat = json.loads(sorted(res.logs.glob("heartbeat_rank0_*.json"))[-1].read_text())
    assert beat["epoch"] == (n + 5) // PER_EPOCH, beat
    assert re.search(
        rf"Processing \d/4 files from train_shards \(\d+ samples planned, epoch {epoch}\)", rank0
    )
    lrs = _lrs(rank0)
    assert min(lrs) == n + 1  # the first step after the checkpoint's
    for step, lr in lrs.items():  # constant warmup: LR after k steps is 2e-3 * (k + 1) / 1000
        assert lr == pytest.approx(2e-3 * (step + 1) / 1000, rel=2e-3)
    assert yaml.safe_load((out / "config.yaml").read_text())["resume_from_checkpoint"] == "last"
