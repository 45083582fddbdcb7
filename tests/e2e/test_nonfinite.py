"""End-to-end non-finite values (`--on_nonfinite`, `ae.training.nonfinite`): 2 ranks (gloo, CPU),
one sample of one shard read by rank 1 holds a real NaN. Three launches, one per mode, each
shared by the assertions on it: the verdict names rank 1, the step, the shard and the key; `skip`
finishes and says how many steps it skipped; `rollback` finishes from the checkpoint before;
no checkpoint of any of them holds a non-finite value."""

from __future__ import annotations

import csv
import json
import math
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ae.data.planning.plan import plan_epoch
from ae.data.shards.writer import write_shard
from ae.log_lines import NONFINITE, NONFINITE_SKIPPED, NONFINITE_SUMMARY, ROLLBACK
from ae.training.position.checkpoint_read import load
from tests.support.runs import ROOT, RunResult, run_launcher, shared_launches
from tests.support.shards import nan_sample, vector_samples

pytestmark = [pytest.mark.slow, shared_launches(__name__)]

COUNTS = [40, 40, 40, 40]  # 10 batches of 8 per rank and epoch
BATCH, NAN_BATCH, SEED = 8, 5, 42  # rank 1's 6th batch (step 6) holds the NaN
STEP = NAN_BATCH + 1
STEP_LOSS = re.compile(r"\] Training step (\d+), loss=(\S+?)[,\s]")


def nan_shards(folder: Path) -> tuple[str, str, str]:
    """The train spec, and the shard and key of the NaN sample: sample 3 of rank 1's batch
    NAN_BATCH (no shuffle buffer: a slot reads its planned slices in order)."""
    plan = plan_epoch(COUNTS, world_size=2, num_workers=1, batch_size=BATCH, seed=SEED)
    position = NAN_BATCH * BATCH + 3
    for s in plan.slot_slices(1, 0):
        if position < s.stop - s.start:
            shard, index = s.shard, s.start + position
            break
        position -= s.stop - s.start
    start, key = 0, ""
    for i, n in enumerate(COUNTS):
        samples = vector_samples(n, 16, start)
        if i == shard:
            key = samples[index]["__key__"].decode()
            samples[index] = nan_sample(key)
        write_shard(folder / f"train-{i:06d}.tar", samples)
        start += n
    write_shard(folder / "val-000000.tar", vector_samples(16, 16, 1000))
    return str(folder / "train-{000000..000003}.tar"), str(folder / f"train-{shard:06d}.tar"), key


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str, str, str]:
    folder = tmp_path_factory.mktemp("nonfinite")
    spec, shard, key = nan_shards(folder / "shards")
    return folder, spec, shard, key


def launch(data: tuple[Path, str, str, str], mode: str) -> RunResult:
    folder, spec, _, _ = data
    args = [f"--train_shards={spec}", f"--val_shards={folder / 'shards' / 'val-000000.tar'}",
            f"--batch_size={BATCH}", "--num_workers=1", "--shuffle_buffer=0", "--max_epochs=-1",
            "--max_steps=9", "--checkpointing_period=2", "--debug=true",
            "--log_every_n_train_batches=1", f"--seed={SEED}",
            f"--on_nonfinite={mode}"]  # fmt: skip
    return run_launcher(args, folder / mode)


@pytest.fixture(scope="module")
def stopped(data: tuple[Path, str, str, str]) -> RunResult:
    return launch(data, "stop")


@pytest.fixture(scope="module")
def skipped(data: tuple[Path, str, str, str]) -> RunResult:
    return launch(data, "skip")


@pytest.fixture(scope="module")
def rolled_back(data: tuple[Path, str, str, str]) -> RunResult:
    return launch(data, "rollback")


def diagnose_json(res: RunResult) -> dict:
    out = subprocess.run(
        [sys.executable, "-m", "ae.diagnose", str(res.logs), "--json"],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def lines(res: RunResult, rank: int, fmt) -> list[dict[str, str]]:
    [log] = res.log(f"debug_rank{rank}_*.log")
    return [m for line in log.read_text().splitlines() if (m := fmt.parse(line))]


def assert_no_nonfinite_checkpoint(res: RunResult) -> list[int]:
    """Every checkpoint's tensors are finite; returns the steps of the step checkpoints."""
    folder = res.logs.parent / "checkpoints"
    files = sorted(folder.glob("*.ckpt"))
    assert files
    for f in files:
        ckpt = load(f)
        tensors = [t for t in ckpt["state_dict"].values() if t.is_floating_point()]
        for opt in ckpt["optimizer_states"]:
            tensors += [v for s in opt["state"].values() for v in s.values()
                        if torch.is_tensor(v) and v.is_floating_point()]  # fmt: skip
        assert all(torch.isfinite(t).all() for t in tensors), f.name
    return sorted(int(f.stem.split("-")[1]) for f in files if f.stem.startswith("step-"))


def assert_names_the_sample(res: RunResult, data: tuple[Path, str, str, str]) -> None:
    """Rank 1, not rank 0, names step STEP, the shard and the key of the NaN sample; its own
    loss line of that step is the first NaN."""
    _, _, shard, key = data
    [line] = lines(res, 1, NONFINITE)
    assert (line["rank"], line["step"], line["epoch"], line["batch"]) == (
        "1",
        str(STEP),
        "0",
        str(NAN_BATCH),
    )
    assert line["value"] == "loss=nan"
    assert line["samples"] == f"shard {shard}, keys [{key}] (non-finite input)"
    assert lines(res, 0, NONFINITE) == []  # rank 0 got it through the all-reduce
    [log] = res.log("debug_rank1_*.log")
    losses = {int(s): loss for s, loss in STEP_LOSS.findall(log.read_text())}
    assert all(math.isfinite(float(losses[s])) for s in range(1, STEP)), losses
    assert losses.get(STEP, "nan") == "nan"  # a run that stops there writes no step line


def assert_finite_epoch_means(res: RunResult) -> None:
    """`train/loss_epoch` leaves out the step that was skipped or rolled back: finite."""
    [metrics] = (res.logs.parent / "metrics").glob("*/metrics.csv")
    with metrics.open(newline="") as f:
        means = [float(r["train/loss_epoch"]) for r in csv.DictReader(f) if r["train/loss_epoch"]]
    assert means and all(math.isfinite(m) for m in means), means


def test_stop_names_rank_1_step_shard_and_key_and_saves_nothing_after(stopped, data) -> None:
    assert stopped.returncode != 0, stopped.output
    assert_names_the_sample(stopped, data)
    _, _, shard, key = data
    doc = diagnose_json(stopped)
    assert doc["status"] == "failed"
    [culprit] = doc["culprits"]
    assert culprit["rank"] == 1 and culprit["cause"] == f"non-finite loss=nan at step {STEP}"
    assert shard in culprit["evidence"][0]["text"] and key in culprit["evidence"][0]["text"]
    assert [v["rank"] for v in doc["victims"]] == [0]
    [first] = doc["nonfinite"]["first"]
    assert (first["rank"], first["step"]) == (1, STEP)
    # The console: rank 1's line (the launcher's report of the ranks' errors), rank 0's stop.
    # Each once: the NONFINITE line whole, the error worded for stop; then the command for more.
    assert stopped.output.count(f"NONFINITE loss=nan on rank 1 at step {STEP} ") == 1
    assert stopped.output.count(f"keys [{key}] (non-finite input)\n") == 1
    assert stopped.output.count(f"non-finite value at step {STEP} (--on_nonfinite=stop): ") == 1
    assert "survived" not in stopped.output
    assert f"Stopping at step {STEP}: non-finite value" in stopped.output
    assert f"More: ae-diagnose {stopped.logs} --run {doc['run']}" in stopped.output
    assert max(assert_no_nonfinite_checkpoint(stopped)) < STEP


def test_skip_finishes_and_says_how_many_steps_it_skipped(skipped, data) -> None:
    assert skipped.returncode == 0, skipped.output
    assert_names_the_sample(skipped, data)
    for rank in (0, 1):  # every rank skipped the same step
        assert [m["step"] for m in lines(skipped, rank, NONFINITE_SKIPPED)] == [str(STEP)]
    [summary] = [m for line in skipped.output.splitlines() if (m := NONFINITE_SUMMARY.parse(line))]
    assert (summary["skipped"], summary["rollbacks"]) == ("1", "0")
    doc = diagnose_json(skipped)
    assert doc["status"] == "finished" and doc["culprits"] == []
    assert doc["nonfinite"]["skipped_steps"] == 1
    assert assert_no_nonfinite_checkpoint(skipped)[-1] == 9  # the final one, finite
    assert_finite_epoch_means(skipped)
    # The skipped step changed no weight: the losses after it are finite on both ranks.
    for rank in (0, 1):
        [log] = skipped.log(f"debug_rank{rank}_*.log")
        losses = {int(s): v for s, v in STEP_LOSS.findall(log.read_text())}
        assert all(math.isfinite(float(v)) for s, v in losses.items() if s != STEP), losses


def test_rollback_finishes_from_the_checkpoint_before(rolled_back, data) -> None:
    assert rolled_back.returncode == 0, rolled_back.output
    assert_names_the_sample(rolled_back, data)
    for rank in (0, 1):
        [m] = lines(rolled_back, rank, ROLLBACK)
        # The newest checkpoint before step STEP is step 4's (every 2 steps).
        assert (m["step"], m["to"]) == (str(STEP), "4")
        assert m["path"].endswith("step-00000004.ckpt")
    doc = diagnose_json(rolled_back)
    assert doc["status"] == "finished" and doc["nonfinite"]["rollbacks"] == 1
    steps = assert_no_nonfinite_checkpoint(rolled_back)
    assert steps[-1] == 9
    assert_finite_epoch_means(rolled_back)
    # After the rollback the weights are step 4's: step 7's loss on rank 0 is finite.
    [log] = rolled_back.log("debug_rank0_*.log")
    losses = {int(s): v for s, v in STEP_LOSS.findall(log.read_text())}
    assert all(math.isfinite(float(losses[s])) for s in (7, 8, 9)), losses
