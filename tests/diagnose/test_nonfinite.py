"""Non-finite steps a run survived (`--on_nonfinite=skip|rollback`), in ae-diagnose's plain view
as in `--json`: on synthetic logs written with the real line formats (bench/synthetic_logs.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rich.console import Console

from ae.diagnose.log_files import find_run
from ae.diagnose.report import diagnose, render, verdict_lines
from ae.log_lines import NONFINITE, NONFINITE_RECEIVED, NONFINITE_SKIPPED, ROLLBACK
from bench.synthetic_logs import RankWriter, write_train_log

CKPT = "/runs/ae/checkpoints/step-00000030.ckpt"


def _run(logs: Path, survived: list[tuple[int, str]]) -> dict[str, Any]:
    """Two ranks that finish; rank 1's own loss turns NaN at each (step, how) of `survived`,
    rank 0 gets it through the all-reduce, and both ranks write what they did about it."""
    write_train_log(logs, 2)
    w0, w1 = RankWriter(logs, 0, 2), RankWriter(logs, 1, 2)
    for w in (w0, w1):
        w.start()
        w.steps(1, 33)
    for n, (step, how) in enumerate(survived, 1):
        own = NONFINITE.format(
            value="loss=nan", rank=1, step=step, epoch=0, batch=str(step - 1),
            samples="shard /d/a-000001.tar, keys [a]",
        )  # fmt: skip
        w1.log(own, "ERROR")
        w0.log(NONFINITE_RECEIVED.format(step=step), "WARNING")
        for w in (w0, w1):
            if how == "skip":
                w.log(NONFINITE_SKIPPED.format(step=step, skipped=n, limit=10), "WARNING")
            else:
                w.log(ROLLBACK.format(step=step, path=CKPT, to=30, count=n, limit=10), "WARNING")
    for w in (w0, w1):
        w.steps(38, 40)
        w.exit()
        w.flush()
    return diagnose(find_run(logs))


def _plain(doc: dict[str, Any], capsys) -> str:
    render(doc, Console(width=300))
    return capsys.readouterr().out


def test_a_skipped_step_is_said_in_the_plain_view(tmp_path: Path, capsys) -> None:
    doc = _run(tmp_path, [(37, "skip")])
    assert doc["status"] == "finished" and doc["culprits"] == []
    assert doc["nonfinite"]["skipped_steps"] == 1
    said = _plain(doc, capsys)
    line = "Non-finite loss: step 37 skipped (rank 1, loss=nan); the run went on"
    assert line in said.splitlines()
    # The launcher's console, after a failure that names no rank, says it in the same words
    assert line in verdict_lines({**doc, "status": "failed"})


def test_rolled_back_steps_are_said_with_their_count(tmp_path: Path, capsys) -> None:
    doc = _run(tmp_path, [(34, "rollback"), (37, "rollback")])
    said = _plain(doc, capsys)
    assert (
        "Non-finite loss: step 34 rolled back (rank 1, loss=nan), 2 steps rolled back in all; "
        "the run went on"
    ) in said.splitlines()


def test_a_run_without_non_finite_steps_says_nothing_of_them(tmp_path: Path, capsys) -> None:
    assert "Non-finite" not in _plain(_run(tmp_path, []), capsys)


def test_a_run_stopped_after_a_skipped_step_names_the_step_that_stopped_it(
    tmp_path: Path, capsys
) -> None:
    # --on_nonfinite=skip --max_skipped_steps=1: rank 1's NaN at step 11 is skipped, rank 0's
    # at step 16 stops the run. The culprit is rank 0 at step 16, not the step survived.
    write_train_log(tmp_path, 2)
    w0, w1 = RankWriter(tmp_path, 0, 2), RankWriter(tmp_path, 1, 2)
    for w in (w0, w1):
        w.start()
        w.steps(1, 10)
    w1.nonfinite(11, "/d/a-000001.tar", peers=(w0,))
    for w in (w0, w1):
        w.log(NONFINITE_SKIPPED.format(step=11, skipped=1, limit=1), "WARNING")
        w.steps(12, 15)
    w0.log(NONFINITE.format(value="loss=nan", rank=0, step=16, epoch=0, batch="15",
                            samples="shard /d/a-000002.tar, keys [b]"), "ERROR")  # fmt: skip
    w1.log(NONFINITE_RECEIVED.format(step=16), "WARNING")
    for w in (w0, w1):
        w.exit(2, "NonFiniteError")
        w.flush()
    doc = diagnose(find_run(tmp_path))
    assert [(c["rank"], c["cause"]) for c in doc["culprits"]] == [
        (0, "non-finite loss=nan at step 16")
    ]
    assert [v["rank"] for v in doc["victims"]] == [1]
    said = _plain(doc, capsys)
    # No rank held the run back: it stopped on purpose (was: `Verdict: held back by rank 1`)
    assert "Verdict: stopped on a non-finite value of rank 0" in said
    assert "rank 1: stopped on rank 0's non-finite value" in said
    # The step it survived is still said, as what it was
    assert "Non-finite loss: step 11 skipped (rank 1, loss=nan)" in said
