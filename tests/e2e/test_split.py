"""End-to-end even split: real 2-rank DDP (gloo, CPU) over uneven shards, bad data, a rank
whose data vanishes."""

from __future__ import annotations

import re
import time
from pathlib import Path

import numpy as np
import pytest

from ae.data.shards.writer import npy_bytes, write_shard
from tests.support.runs import RunResult
from tests.support.shards import vector_samples

pytestmark = pytest.mark.slow

COMMON = ["--max_epochs=2", "--hidden_dim=8", "--latent_dim=4", "--checkpointing_period=0"]


def _batches_per_epoch(text: str) -> dict[int, int]:
    """Training batches a rank ran per epoch (its last `Processed` line of each epoch)."""
    out: dict[int, int] = {}
    for n, epoch in re.findall(r"Processed (\d+) training batches \(epoch (\d+)", text):
        out[int(epoch)] = int(n)
    return out


def _assert_even(res: RunResult, batches: int, batch_size: int, workers: int = 2) -> None:
    assert res.returncode == 0, res.output
    for rank in (0, 1):
        text = res.text(f"debug_rank{rank}_*.log")
        assert _batches_per_epoch(text) == {0: batches, 1: batches}, f"rank {rank}"
        for epoch in (0, 1):  # a fresh (non-persistent) worker per epoch, each with its epoch
            for w in range(workers):
                assert re.search(
                    rf"\[Rank {rank}/2 Worker {w}/{workers}\] Processing \d+/\d+ files from "
                    rf"train_shards \(\d+ samples planned, epoch {epoch}\)",
                    text,
                )
            done = re.findall(rf"total samples: (\d+) \(train, epoch {epoch},", text)
            assert sum(map(int, done)) == batches * batch_size
        plan = rf"Shard plan train: .* -> {batches} batches x {batch_size} per rank"
        assert re.search(plan, text)


def _spec(make_shards, sizes: list[int], name: str = "train") -> tuple[str, Path]:
    spec = make_shards(sizes, name=name)
    return spec, Path(spec).parent


@pytest.mark.parametrize(
    ("sizes", "batch_size", "mode", "batches", "plan"),
    [
        # 3 shards for 2 ranks x 2 workers: 21 // (2 x 2) = 5 batches; 1 dropped
        ([7, 5, 9], 2, "drop", 5, "(drop: 1 dropped, 0 repeated)"),
        # 1050 samples, ceil(1050 / (2 x 16)) = 33 batches; 6 samples repeated to fill
        ([100] * 10 + [50], 16, "pad", 33, "(pad: 0 dropped, 6 repeated)"),
    ],
    ids=["3-shards-4-slots", "11-shards-pad"],  # drop over indexed shards: test_bad_data_...
)
def test_every_rank_runs_the_same_batches(
    launch, make_shards, sizes: list[int], batch_size: int, mode: str, batches: int, plan: str
) -> None:
    train, folder = _spec(make_shards, sizes)
    val = make_shards([6, 6], name="val")
    unindexed = len(sizes) == 3
    if unindexed:  # no sidecars: local rank 0 scans the tar headers, once
        for idx in folder.glob("train-*.idx"):
            idx.unlink()
    res = launch(
        [f"--train_shards={train}", f"--val_shards={val}", f"--batch_size={batch_size}",
         "--num_workers=2", f"--shard_split={mode}", "--log_every_n_train_batches=2", *COMMON],
    )  # fmt: skip
    _assert_even(res, batches, batch_size)
    assert plan in res.text("train_*.log")
    rank0, rank1 = res.text("debug_rank0_*.log"), res.text("debug_rank1_*.log")
    n = len(sizes)
    # every rank counts a share and gets the whole: the same line on both
    counted = f"({n - 3 * unindexed} from index, {3 * unindexed} scanned) counted in"
    for text in (rank0, rank1):
        line = f"Shard counts train_shards: {n} shards, {sum(sizes)} samples {counted}"
        assert re.search(re.escape(line) + r" [\d.]+s on 2 rank\(s\), cached in ", text)


def _truncate(path: Path, sample: int) -> None:
    """Cut a shard inside sample `sample`'s body; its index (if any) is now stale."""
    data = path.read_bytes()
    path.write_bytes(data[: sample * 1024 + 700])


def test_bad_data_is_logged_and_replaced(launch, make_shards, tmp_path: Path) -> None:
    train, folder = _spec(make_shards, [10, 10, 10, 10])
    bad = vector_samples(10, 16, start=10)
    bad[3]["npy"] = npy_bytes(np.zeros(7, "float32"))  # wrong shape
    bad[6]["npy"] = b"\x93NUMPY broken"  # does not decode
    write_shard(folder / "train-000001.tar", bad)
    _truncate(folder / "train-000002.tar", 6)  # local: the stale index is caught at planning
    piped = tmp_path / "piped.tar"  # through a pipe: caught when read, and replaced
    write_shard(piped, vector_samples(10, 16, start=40))
    _truncate(piped, 4)
    val = make_shards([8], name="val")
    res = launch(
        [f"--train_shards={train}::pipe:cat {piped}", f"--val_shards={val}", "--batch_size=4",
         "--num_workers=2", "--max_bad_fraction=0.5", *COMMON],  # repeats wanted here
    )  # fmt: skip
    # 10 + 10 + 6 (counted) + 10 + 10 (indexed) = 46 -> 46 // 8 = 5 batches per rank, 6 dropped
    _assert_even(res, 5, 4)
    assert "-> 5 batches x 4 per rank on 2 ranks x 2 workers (drop: 6 dropped, 0 repeated)" in (
        res.text("train_*.log")
    )
    logs = res.text("debug_rank*.log")
    errors = "\n".join(line for line in logs.splitlines() if re.search("ERROR.*shard", line))
    shard1 = folder / "train-000001.tar"
    assert f"Bad sample 00000013 in shard {shard1}: shape (7,), expected (16,)" in errors
    assert f"Bad sample 00000016 in shard {shard1}: cannot decode .npy" in errors
    errors = errors.splitlines()
    assert any(
        "train-000002.tar: TruncatedTar: truncated" in e and "counted 6 whole" in e for e in errors
    )
    assert any(f"Bad shard pipe:cat {piped}: TruncatedTar" in e for e in errors)
    main = res.text("train_*.log")
    assert "Bad shard pipe:cat" in main and "Bad sample 00000016" in main  # every ERROR there too
    summary = re.findall(r"WARNING .*Data errors train_shards: (\d+) bad samples, (\d+) bad", main)
    assert sum(int(s) + int(b) for s, b in summary) >= 4  # 2 bad samples + 1 bad read, x2 epochs
    # The console speaks for every rank: the workers' ERROR lines, each rank's summary.
    assert re.search(r"rank \d worker \d: Bad (sample|shard) ", res.output), res.output
    for rank, line in re.findall(r"WARNING .*\[Rank (\d)/2\] (Data errors train_shards: .*)", main):
        if rank != "0":  # rank 0's is its own console line
            assert f"rank {rank}: {line}" in res.output, res.output


def test_an_epoch_past_max_bad_fraction_stops_with_every_ranks_count(launch, make_shards) -> None:
    """Half of one shard is bad (not seen by the probe): the first epoch trains on repeats, then
    every rank stops alike, exit 2, with each rank's count on the console, last; no second
    epoch."""
    train, folder = _spec(make_shards, [16, 16])
    bad = vector_samples(16, 16, start=16)
    for i in range(1, 16, 2):
        bad[i]["npy"] = npy_bytes(np.zeros(7, "float32"))
    write_shard(folder / "train-000001.tar", bad)
    val = make_shards([8], name="val")
    res = launch(
        [f"--train_shards={train}", f"--val_shards={val}", "--batch_size=4", "--num_workers=1",
         *COMMON],
    )  # fmt: skip
    assert res.returncode == 2, res.output
    found = re.findall(
        r"train_shards: more than --max_bad_fraction=0.01 of epoch 0's samples were bad and "
        r"replaced by repeats of good ones \(rank 0: (\d+) of 16, rank 1: (\d+) of 16\)",
        res.output,
    )
    assert found and set(found) == {found[0]} and sum(map(int, found[0])) == 8, res.output
    # The console's last word before the command for more: said again there when the workers'
    # relayed `Bad sample` lines came after rank 0's own (`RankLines.last_words_said`).
    *_, last, more = res.output.rstrip("\n").splitlines()
    assert "more than --max_bad_fraction=0.01" in last and "More: ae-diagnose" in more, res.output
    assert "Traceback" not in res.output and "EPOCH 1 TRAINING" not in res.text("debug_rank0*")


def test_a_rank_whose_data_vanishes_fails_the_job_without_hanging(
    launch, make_shards, tmp_path: Path
) -> None:
    """Rank 1's shard reads start failing after planning (the count cache exists by then): its
    worker raises, and the job must end promptly, not leave rank 0 waiting in an all-reduce."""
    _, folder = _spec(make_shards, [8, 8])
    cache = tmp_path / "counts"
    gate = f'if [ "$RANK" = 1 ] && ls {cache}/counts-* >/dev/null 2>&1; then exit 1; fi'
    train = "::".join(f"pipe:{gate}; cat {folder}/train-00000{i}.tar" for i in (0, 1))
    val = make_shards([8], name="val")
    t0 = time.monotonic()
    res = launch(
        [f"--train_shards={train}", f"--val_shards={val}", "--batch_size=2", "--num_workers=1",
         f"--count_cache={cache}", *COMMON],
        timeout=180,
    )  # fmt: skip
    assert res.returncode != 0
    assert time.monotonic() - t0 < 150
    rank1 = res.text("debug_rank1_*.log")
    assert re.search(r"ERROR .*\[Rank 1/2 Worker 0/1\] Bad shard pipe:", rank1)
    no_data = "train_shards: no readable sample in any of 2 shards"
    assert re.search(rf"ERROR .*\[Rank 1/2 Worker 0/1\] {no_data}", rank1)  # said by the worker
    assert re.search(rf"ERROR .*\[Rank 1/2\] {no_data} \(rank 1 slot 0", rank1)  # one line


def test_resampled_runs_equal_steps_without_counting(launch, make_shards) -> None:
    """--shard_split=resampled over very uneven shards, one without a sidecar: no train count
    at all, the same batches on every rank, the plan line says so; validation is counted."""
    train, folder = _spec(make_shards, [3, 40, 1, 17, 9])
    (folder / "train-000001.tar.idx").unlink()
    val = make_shards([6, 6], name="val")
    res = launch(
        [f"--train_shards={train}", f"--val_shards={val}", "--batch_size=4", "--num_workers=2",
         "--shard_split=resampled", "--epoch_samples=100", *COMMON],
    )  # fmt: skip
    _assert_even(res, 12, 4)  # 100 // (2 ranks x 4) = 12 batches per rank, every epoch
    main = res.text("train_*.log")
    assert "Shard plan train: 5 shards, 100 samples -> 12 batches x 4 per rank" in main
    assert "(resampled: 4 dropped, 0 repeated)" in main
    logs = res.text("debug_rank*.log")
    assert "Shard counts train_shards" not in logs and "Counting train_shards" not in logs
    assert "Shard counts val_shards: 2 shards, 12 samples" in logs
    assert not (folder / "train-000001.tar.idx").exists()  # never walked, so never indexed
