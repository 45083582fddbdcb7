"""Resuming after a change of settings: the rest of the interrupted epoch is trained on once, the
LR schedule ends at the run's new end, and another model is refused before training."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest
import torch

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
    for i, (n, start) in enumerate([(40, 0), (30, 40), (50, 70)]):
        write_shard(data / f"train-{i:06d}.tar", id_samples(n, start=start))
    write_shard(data / "val-000000.tar", id_samples(16, start=1000))
    keys = tmp_path / "keys"
    keys.mkdir()
    out, env = tmp_path / "run", {"AE_TEST_KEYS": str(keys)}
    common = [
        f"--train_shards={data}/train-{{000000..000002}}.tar",
        f"--val_shards={data}/val-000000.tar", MODEL, "--num_workers=1", "--warmup_steps=1",
    ]  # fmt: skip
    # 2 ranks x batch 8: 7 batches per epoch; stopped after 3 of them (48 samples)
    first = run_launcher([*common, "--devices=2", "--batch_size=8", "--max_steps=3"], out, env)
    assert first.returncode == 0, first.output[-3000:]
    trained = _keys(keys)
    assert len(trained) == 48
    # 1 rank x batch 5 (and 2 workers): the rest of epoch 0, each sample once (14 batches),
    # then epoch 1 whole in the new settings (24 batches)
    resume = ["--resume_from_checkpoint=last", "--max_steps=-1", "--max_epochs=2"]
    second = run_launcher(
        [*common, "--devices=1", "--batch_size=5", "--num_workers=2", *resume], out, env
    )
    assert second.returncode == 0, second.output[-3000:]
    batches = _batches(keys)
    assert len(batches) == 14 + 24
    rest = [k for batch in batches[:14] for k in batch]
    assert sorted(k for batch in batches[14:] for k in batch) == list(range(120))
    assert not set(rest) & set(trained)
    assert Counter(rest).most_common(1)[0][1] == 1
    assert len(rest) == (120 - 48) // 5 * 5  # the new split drops fewer than one batch
    assert len(set(trained) | set(rest)) == 120 - (120 - 48) % 5
    assert "Settings changed since the checkpoint:" in second.output
    assert "re-split the rest of epoch 0 (72 samples not yet trained on)" in second.output
    assert "re-planned the LR schedule from 3 to 41 steps" in second.output
    assert "Epoch 0 done: 17 batches" in second.output  # 3 before the resume, 14 after
    assert "Epoch 1 done: 24 batches" in second.output
    # an end-of-epoch checkpoint, resumed on 2 ranks x batch 4 with one more epoch: epoch 2
    # from its first batch, whole; the LR schedule ends at the run's last step
    third = run_launcher(
        [*common, "--devices=2", "--batch_size=4", "--resume_from_checkpoint=last",
         "--max_epochs=3"], out, env,
    )  # fmt: skip
    assert third.returncode == 0, third.output[-3000:]
    epoch2 = _keys(keys)
    assert len(epoch2) == len(set(epoch2)) == 120  # 15 batches x 4 x 2 ranks
    ckpt = torch.load(out / "checkpoints" / "last.ckpt", weights_only=False)
    assert ckpt["global_step"] == 41 + 15
    assert ckpt["lr_schedulers"][0]["lr_lambdas"][0]["total_steps"] == 56
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
