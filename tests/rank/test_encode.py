"""One ae-encode rank, run as the launcher's torchrun runs it, in one process: what it writes and
says when an input shard is damaged in the middle."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from ae.data.decoding.decode import InputSpec
from tests.support.encode_checkpoint import encode_checkpoint
from tests.support.runs import ROOT
from tests.support.shards import write_test_shards


def test_a_shard_damaged_in_the_middle_is_named_not_written_and_the_exit_is_honest(
    tmp_path: Path,
) -> None:
    """A shard whose tar breaks at its third sample's header (its index, of the right size,
    counts 4; the reader is sure of 1): the rank wrote that 1 sample as a complete output shard,
    summed "11 of 14 samples written (1 bad samples skipped)" (a shard read counted as a
    sample, 2 samples unaccounted for), said "0 of 1 planned samples lost", and exited 0. A
    run of the same command would then skip that partial output as complete. Now: no output
    for it, every sample of the plan accounted for, the shard named with what to do, exit 2."""
    ckpt = encode_checkpoint(tmp_path, InputSpec("vector", (12,)))
    spec = write_test_shards(tmp_path / "in", [5, 4, 5], dim=12)
    damaged = tmp_path / "in" / "train-000001.tar"
    data = bytearray(damaged.read_bytes())
    data[2048:2560] = b"\xff" * 512  # the third sample's header
    damaged.write_bytes(bytes(data))
    out = tmp_path / "out"
    proc = subprocess.run(
        [sys.executable, "-m", "ae.cli.encode_rank", str(ckpt), spec, str(out), "--devices=1",
         "--num_workers=0", "--keep_fields=npy,cls"],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
        env={**os.environ, "AE_CACHE_DIR": str(tmp_path / "cache")},
    )  # fmt: skip
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert sorted(p.name for p in out.glob("*.tar")) == ["train-000000.tar", "train-000002.tar"]
    assert not [p for p in out.iterdir() if p.name.startswith(".")]  # no temporary file left
    (summary,) = (out / "logs").glob("train_*.log")
    text = summary.read_text()
    assert "Encoding done: 10 of 14 samples written (4 bad samples skipped) to 2 shards" in text
    assert "(after sample 00000005; 3 of 4 planned samples lost)" in text
    assert f"Not encoded: {damaged} could not be read to its end" in text
    # --keep_fields naming a field no sample has: nothing copied, silently; now said
    assert "WARNING  | [Rank 0/1] keep_fields: no input sample has a field cls: nothing" in text
    assert (
        f'SPEC: 1 input shard(s) could not be read to their end: {damaged} (grep "Bad shard" '
        f"{out}/logs/train_*.log says where); their outputs are not written, the other 2 are. "
        "Replace or remove those inputs, then run the same command again: it skips the "
        "complete outputs"
    ) in text


def test_ctrl_c_during_the_imports_ends_the_rank_without_a_traceback(tmp_path: Path) -> None:
    """torchrun passes the launcher's SIGINT on to its ranks; an ae-encode rank still in its
    imports printed a KeyboardInterrupt traceback (from inside Lightning, re, ...) on the
    console, where a training rank ends quietly. Now it ends as on SIGTERM."""
    ckpt = encode_checkpoint(tmp_path, InputSpec("vector", (12,)))
    spec = write_test_shards(tmp_path / "in", [3], dim=12)
    proc = subprocess.Popen(
        [sys.executable, "-m", "ae.cli.encode_rank", str(ckpt), spec, str(tmp_path / "out")],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "AE_CACHE_DIR": str(tmp_path / "cache")},
    )  # fmt: skip
    time.sleep(1.0)  # python is up, torch is being imported (several seconds)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == -signal.SIGINT, out + err
    assert "Traceback" not in out + err and "KeyboardInterrupt" not in out + err
