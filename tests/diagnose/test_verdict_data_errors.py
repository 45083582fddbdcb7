"""ae-diagnose beside the verdict: ranks whose shard plans differ, the data errors by shard (a
non-finite loss only where its input was), and each rank's errors counted over its rotated
logs, read in order; synthetic logs in the real line formats (bench/synthetic_logs.py)."""

from __future__ import annotations

from pathlib import Path

from ae.log_lines import FAULT_INJECTED, NONFINITE, NONFINITE_INPUT
from tests.diagnose.synthetic_runs import run_diagnose, writers


def test_shard_plan_mismatch_and_data_errors(tmp_path: Path) -> None:
    w0, w1 = writers(tmp_path)
    w1.lines = [line.replace("15 batches", "14 batches") for line in w1.lines]
    for i in range(3):
        w0.log(f"Bad sample 0000{i} in shard /d/train-000002.tar: truncated", "ERROR")
    w1.log("Bad shard /d/train-000007.tar: not a tar file", "ERROR")
    w1.log("ERROR-looking text in an INFO line about a shard", "INFO")
    for w in (w0, w1):
        w.exit()
        w.flush()
    doc = run_diagnose(tmp_path)
    assert list(doc["shard_plan_mismatch"]) == ["train"]
    assert "batches=14" in doc["shard_plan_mismatch"]["train"]["1"]
    errors = doc["data_errors"]
    assert errors["lines"] == 4
    assert [(s["shard"], s["lines"], s["ranks"]) for s in errors["shards"]] == [
        ("/d/train-000002.tar", 3, [0]),
        ("/d/train-000007.tar", 1, [1]),
    ]
    assert [r["errors"] for r in doc["ranks"]] == [3, 1]


def test_a_non_finite_loss_is_a_data_error_only_when_its_input_was(tmp_path: Path) -> None:
    """An injected NaN (finite inputs) names the batch's healthy shard: no data error there; a
    sample whose decoded array held a NaN is one."""
    w0, w1 = writers(tmp_path)
    fault = FAULT_INJECTED.format(action="nan", point="train", step=5, rank=1,
                                  effect=": the loss of optimizer step 6 turns NaN")  # fmt: skip
    w1.log(fault, "WARNING")
    w1.log(NONFINITE.format(value="loss=nan", rank=1, step=6, epoch=0, batch="5",
                            samples="shard /d/train-000000.tar, keys [a, b]"), "ERROR")  # fmt: skip
    w0.log(NONFINITE.format(value="loss=nan", rank=0, step=9, epoch=0, batch="8",
                            samples=f"shard /d/train-000003.tar, keys [c] {NONFINITE_INPUT}"),
           "ERROR")  # fmt: skip
    for w in (w0, w1):
        w.exit()
        w.flush()
    errors = run_diagnose(tmp_path)["data_errors"]
    assert errors["lines"] == 1
    assert [(s["shard"], s["ranks"]) for s in errors["shards"]] == [("/d/train-000003.tar", [0])]


def test_rotated_logs_are_read_in_order(tmp_path: Path) -> None:
    (w0, w1) = writers(tmp_path)
    w0.steps(1, 5)
    w0.log("old error", "ERROR")
    w0.flush()
    w0.path.rename(w0.path.with_name(w0.path.name + ".1"))
    w0.steps(6, 7)
    w0.exit()
    w0.flush()
    w1.steps(1, 7)
    w1.exit()
    w1.flush()
    doc = run_diagnose(tmp_path)
    r0 = doc["ranks"][0]
    assert r0["errors"] == 1 and r0["step"] == 7 and r0["state"] == "exited"
    assert r0["logs"] == [f"{w0.path.name}.1", w0.path.name]
