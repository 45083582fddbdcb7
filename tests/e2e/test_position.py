"""The run's position end to end (issue 34): the two continuations that lost batches, on one run
folder whose launches the assertions share. 1,200 vector samples, val on its own shard, a model
that records every sample it trains on (tests/support/key_recorder.py):

1. 2 ranks x batch 16, 2 epochs (37 batches each: 74 steps), then the same folder with batch 8
   and `--max_epochs=4`: epochs 2 and 3 whole (75 batches each), the run ends at step 224, the
   step its LR schedule announced (Lightning alone stopped at 187, reading the end-of-epoch
   checkpoint as "batch 37 of 75").
2. That end-of-epoch checkpoint of 2 ranks resumed on 1 rank (a job that lost a node):
   epoch 4 whole, 150 batches, step 374.
3. The same command again: the run is at --max_epochs already; it says so and trains nothing.
4. A truncated checkpoint, in the same folder: one message naming it damaged and the newest
   complete one, exit 2; the folder's config.yaml stays that of the run that trained.
Lightning's "dataloader is not resumable" warning appears in no log of any of them, and
`ae-diagnose --json` gives each attempt's samples per epoch.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from ae.data.shards.writer import write_shard
from ae.training.lr import lr_factor, scale_lr
from tests.support.runs import ROOT, RunResult, run_launcher, shared_launches
from tests.support.shards import id_samples

pytestmark = [pytest.mark.slow, shared_launches(__name__)]
SAMPLES = 1200
LIGHTNING_WARNING = "dataloader is not resumable"


def _rank_batches(keys: Path) -> dict[int, list[list[int]]]:
    """Each rank's batches (sample numbers) since the last call, in order."""
    out = {}
    for f in sorted(keys.glob("rank*.txt")):
        out[int(f.stem[4:])] = [[int(v) for v in ln.split()] for ln in f.read_text().splitlines()]
        f.unlink()
    return out


def _epoch_samples(ranks: dict[int, list[list[int]]], first: int, count: int) -> list[int]:
    return [k for batches in ranks.values() for b in batches[first : first + count] for k in b]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    tmp = tmp_path_factory.mktemp("position")
    data = tmp / "data"
    write_shard(data / "train-000000.tar", id_samples(700))
    write_shard(data / "train-000001.tar", id_samples(500, start=700))
    write_shard(data / "val-000000.tar", id_samples(64, start=5000))
    keys = tmp / "keys"
    keys.mkdir()
    out, env = tmp / "run", {"AE_TEST_KEYS": str(keys)}
    common = [
        f"--train_shards={data}/train-{{000000..000001}}.tar",
        f"--val_shards={data}/val-000000.tar",
        "--model=tests.support.key_recorder:KeyRecorder", "--num_workers=1", "--warmup_steps=1",
        "--checkpointing_period=0",
    ]  # fmt: skip
    found: dict[str, object] = {"out": out}
    first = run_launcher([*common, "--devices=2", "--batch_size=16", "--max_epochs=2"], out, env)
    found["first"], found["first_keys"] = first, _rank_batches(keys)
    resume = ["--resume_from_checkpoint=last"]
    second = run_launcher(
        [*common, "--devices=2", "--batch_size=8", "--max_epochs=4", *resume], out, env
    )
    found["second"], found["second_keys"] = second, _rank_batches(keys)
    found["second_json"] = _diagnose(out)
    third = run_launcher(
        [*common, "--devices=1", "--batch_size=8", "--max_epochs=5", *resume], out, env
    )
    found["third"], found["third_keys"] = third, _rank_batches(keys)
    found["third_json"] = _diagnose(out)
    again = run_launcher(  # the same command once more: the run is at its end already
        [*common, "--devices=1", "--batch_size=8", "--max_epochs=5", *resume], out, env
    )
    found["again"], found["again_keys"] = again, _rank_batches(keys)
    # a truncated copy of a complete checkpoint, beside it in the run's folder (one of another
    # folder would be refused over this folder's checkpoints before it is read)
    ckpts = out / "checkpoints"
    whole = max(ckpts.glob("step-*.ckpt"))  # the newest by step
    damaged = ckpts / "step-00099999.ckpt"
    damaged.write_bytes(whole.read_bytes()[:5000])
    found["config_before_damaged"] = (out / "config.yaml").read_text()
    found["damaged"] = run_launcher(
        [*common, "--devices=1", "--max_epochs=6", f"--resume_from_checkpoint={damaged}"], out, env
    )
    found["damaged_paths"] = (damaged, whole)
    return found


def _diagnose(out: Path) -> dict:
    proc = subprocess.run(
        [sys.executable, "-m", "ae.diagnose", str(out / "logs"), "--json"],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    return json.loads(proc.stdout)


def _all_logs(out: Path) -> str:
    return "".join(p.read_text(errors="replace") for p in (out / "logs").glob("*.log"))


def test_batch_size_halved_trains_epochs_whole_and_ends_at_the_announced_step(runs) -> None:
    first, second = runs["first"], runs["second"]
    assert isinstance(first, RunResult) and isinstance(second, RunResult)
    assert first.returncode == 0, first.output[-3000:]
    assert second.returncode == 0, second.output[-3000:]
    assert "Training finished at step 74" in first.output
    assert "Training finished at step 224" in second.output, second.output[-3000:]
    assert "re-planned the LR schedule from 74 to 224 steps" in second.output
    # ... and the LR said and used from the resume is the new plan's at step 74 (the first run's
    # plan had ended: LR 0), on 2 ranks (sqrt: x 1.414), warmup 1, cosine
    lr = re.search(r"Resumed from \S+ at step 74 \(epoch 2, LR (\S+)\)", second.output)
    assert lr and float(lr[1]) == pytest.approx(
        scale_lr(1e-3, 2, "sqrt") * lr_factor(74, warmup_steps=1, total_steps=224, kind="cosine"),
        rel=1e-6,
    ), second.output[-3000:]
    assert (
        "(epoch 2, LR " in second.output and "batch 0 of 75 of the epoch, 0 of its" in second.output
    )
    ranks = runs["second_keys"]
    assert [len(b) for b in ranks.values()] == [150, 150]  # epochs 2 and 3, 75 batches a rank
    for first_batch in (0, 75):
        epoch = _epoch_samples(ranks, first_batch, 75)
        assert sorted(epoch) == list(range(SAMPLES))  # every sample once


def test_end_of_epoch_checkpoint_of_two_ranks_resumed_on_one_trains_the_next_epoch_whole(
    runs,
) -> None:
    third = runs["third"]
    assert isinstance(third, RunResult)
    assert third.returncode == 0, third.output[-3000:]
    assert "Training finished at step 374" in third.output, third.output[-3000:]
    ranks = runs["third_keys"]
    assert list(ranks) == [0] and len(ranks[0]) == 150
    assert sorted(_epoch_samples(ranks, 0, 150)) == list(range(SAMPLES))


def test_a_resume_at_its_max_epochs_already_says_nothing_is_left(runs) -> None:
    again = runs["again"]
    assert isinstance(again, RunResult)
    assert again.returncode == 0, again.output[-3000:]
    assert "Training finished at step 374" in again.output
    assert "is at step 374, where --max_epochs=5 ends the run; raise it" in again.output
    assert not any(runs["again_keys"].values())  # type: ignore[union-attr]


def test_lightning_never_decides_the_position_on_its_own(runs) -> None:
    for name in ("first", "second", "third", "again"):
        run = runs[name]
        assert isinstance(run, RunResult)
        assert LIGHTNING_WARNING not in run.output
    assert LIGHTNING_WARNING not in _all_logs(runs["out"])  # type: ignore[arg-type]


def test_diagnose_reports_the_samples_each_attempt_trained_per_epoch(runs) -> None:
    assert runs["second_json"]["attempts"][-1]["samples_per_epoch"] == {"2": 1200, "3": 1200}
    assert runs["third_json"]["attempts"][-1]["samples_per_epoch"] == {"4": 1200}


def test_a_truncated_checkpoint_is_named_damaged_with_the_newest_complete_one(runs) -> None:
    run = runs["damaged"]
    damaged, whole = runs["damaged_paths"]
    assert isinstance(run, RunResult)
    assert run.returncode == 2, run.output[-3000:]
    assert f"{damaged}: the checkpoint file is damaged" in run.output
    assert f"the newest complete checkpoint beside it is {whole}" in run.output
    assert "Traceback" not in run.output and "PytorchStreamReader" not in run.output
    # the attempt never trained: config.yaml is still the third run's, a --config to go on from
    config = (runs["out"] / "config.yaml").read_text()  # type: ignore[operator]
    assert config == runs["config_before_damaged"] and "max_epochs: 5" in config
