"""Resuming after a change of settings: the rest of the interrupted epoch is trained on once, the
LR schedule ends at the run's new end, validation held out of the train shards (no --val_shards)
stays the samples the first run held out, and another model is refused before training."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest
import torch

from ae.data.planning.holdout import hold_out
from ae.data.shards.writer import write_shard
from tests.support.runs import run_launcher
from tests.support.shards import id_samples

MODEL = "--model=tests.support.key_recorder:KeyRecorder"


def _batches(folder: Path) -> list[list[int]]:
    """The sample numbers of each batch trained since the last call, rank by rank."""
    found = [
        [int(v) for v in line.split()]
        for f in sorted(folder.glob("rank*.txt"))
        for line in f.read_text().splitlines()
    ]
    for f in folder.glob("rank*.txt"):
        f.unlink()
    return found


def _keys(folder: Path) -> list[int]:
    return [k for batch in _batches(folder) for k in batch]


@pytest.mark.slow
def test_resume_with_other_ranks_and_batch_size_trains_the_rest_once(tmp_path: Path) -> None:
    data = tmp_path / "data"
    shards = [(40, 0), (30, 40), (50, 70)]
    for i, (n, start) in enumerate(shards):
        write_shard(data / f"train-{i:06d}.tar", id_samples(n, start=start))
    keys = tmp_path / "keys"
    keys.mkdir()
    out, env = tmp_path / "run", {"AE_TEST_KEYS": str(keys)}
    common = [
        f"--train_shards={data}/train-{{000000..000002}}.tar", MODEL, "--num_workers=1",
        "--warmup_steps=1",
    ]  # fmt: skip
    # No --val_shards: the first run (2 ranks x batch 8) holds out one batch per rank, 16 of the
    # 120 samples, by sample; every resume below holds out the same 16, whatever its batch size
    # and ranks, and never trains on them.
    split = hold_out([n for n, _ in shards], 0.01, 16)
    held = {shards[p.shard][1] + i for p in split.val for i in range(p.start, p.stop)}
    train = sorted(set(range(120)) - held)
    assert len(held) == 16
    held_out = "Validation: 16 of the 120 samples of train_shards held out by sample ("
    # 2 ranks x batch 8 over the other 104: 6 batches per epoch; stopped after 3 (48 samples)
    first = run_launcher([*common, "--devices=2", "--batch_size=8", "--max_steps=3"], out, env)
    assert first.returncode == 0, first.output[-3000:]
    assert held_out + "--val_fraction=0.01, at least one batch per rank)" in first.output
    trained = _keys(keys)
    assert len(trained) == 48 and not set(trained) & held
    # The epoch's loss so far, both ranks' 3 batches, for the resumed epoch's train/loss_epoch
    # (counted once by the 1-rank run below)
    carried = torch.load(out / "checkpoints" / "last.ckpt", weights_only=True)["ae_epoch_loss"]
    assert carried["count"] == 6 and carried["total"] > 0, carried
    # 1 rank x batch 5 (and 2 workers): the rest of epoch 0, each sample once (11 batches),
    # then epoch 1 whole in the new settings (20 batches, 4 samples dropped)
    resume = ["--resume_from_checkpoint=last", "--max_steps=-1", "--max_epochs=2"]
    second = run_launcher(
        [*common, "--devices=1", "--batch_size=5", "--num_workers=2", *resume], out, env
    )
    assert second.returncode == 0, second.output[-3000:]
    resumed = held_out + "as in the run resumed: --val_fraction=0.01, at least 16 samples)"
    assert resumed + ", the same every epoch; training on the other 104." in second.output
    batches = _batches(keys)
    assert len(batches) == 11 + 20
    rest = [k for batch in batches[:11] for k in batch]
    epoch1 = [k for batch in batches[11:] for k in batch]
    assert len(epoch1) == len(set(epoch1)) == 100 and set(epoch1) <= set(train)
    assert not set(rest) & set(trained) and not set(rest) & held
    assert Counter(rest).most_common(1)[0][1] == 1
    assert len(rest) == (104 - 48) // 5 * 5  # the new split drops fewer than one batch
    assert len(set(trained) | set(rest)) == 104 - (104 - 48) % 5
    assert "Settings changed since the checkpoint:" in second.output
    assert "re-split the rest of epoch 0 (56 samples not yet trained on)" in second.output
    assert "re-planned the LR schedule from 3 to 34 steps" in second.output
    assert "Epoch 0 done: 14 batches (11 since the resume) in" in second.output  # 3 before
    assert "Epoch 1 done: 20 batches" in second.output
    # an end-of-epoch checkpoint, resumed on 2 ranks x batch 13 with one more epoch: epoch 2
    # from its first batch, whole (104 = 4 x 13 x 2); the LR schedule ends at the run's last
    # step. Validation keeps its 16 and repeats 10 of them to fill one batch of 13 per rank.
    third = run_launcher(
        [*common, "--devices=2", "--batch_size=13", "--resume_from_checkpoint=last",
         "--max_epochs=3"], out, env,
    )  # fmt: skip
    assert third.returncode == 0, third.output[-3000:]
    assert resumed + ", the same every epoch, 10 of them repeated to fill one batch per rank;" in (
        third.output
    )
    epoch2 = _keys(keys)
    assert sorted(epoch2) == train  # each train sample once, no held-out one
    ckpt = torch.load(out / "checkpoints" / "last.ckpt", weights_only=False)
    assert ckpt["global_step"] == 34 + 4
    assert ckpt["lr_schedulers"][0]["lr_lambdas"][0]["total_steps"] == 38
    assert ckpt["lr_schedulers"][0]["_last_lr"][0] == 0.0  # the cosine's end
    # another model: refused before training, one message, exit 2
    refused = run_launcher(
        [*common, "--devices=1", "--batch_size=4", "--resume_from_checkpoint=last",
         "--max_epochs=4", "--model_args={latent: 3}"], out, env,
    )  # fmt: skip
    assert refused.returncode == 2, refused.output[-3000:]
    assert "holds another model than these flags build (checkpoint -> flags)" in refused.output
    assert "\n  model_args: " in refused.output and "-> {'latent': 3}" in refused.output
    assert "Traceback" not in refused.output and "size mismatch" not in refused.output
    assert not list(keys.glob("rank*.txt"))  # nothing trained
