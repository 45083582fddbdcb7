"""A rank killed after training finished (in teardown): the run is finished, the death a note,
every rank's phase `teardown` (`ae.diagnose.teardown`); synthetic logs in the real formats,
torchrun's report as `launcher_<TS>.log` holds it."""

from __future__ import annotations

from pathlib import Path

import pytest
from rich.console import Console

from ae.diagnose.log_files import find_run
from ae.diagnose.report import diagnose, render, verdict_lines
from ae.log_lines import (
    BEST_SAVE,
    CHECKPOINT_END,
    CHECKPOINT_START,
    LAUNCHER_LOG_FILE,
    STOP_SIGNAL,
    TRAINING_FINISHED,
)
from bench.synthetic_logs import T0, TS, RankWriter, write_heartbeat, write_train_log
from tests.diagnose.synthetic_runs import dead_pid

CKPT = "/runs/ae/checkpoints/step-00000023.ckpt"
BEST = "/runs/ae/checkpoints/best.ckpt"
# torchrun's report as it wrote it in the walkthrough: rank 1's SIGKILL its first end, rank 0
# SIGTERMed by it after that.
REPORT = """\
W1127 17:28:56.002000 28358 torch/distributed/elastic/multiprocessing/api.py:1028] Sending process 4194000 closing signal SIGTERM
E1127 17:28:56.035000 28358 torch/distributed/elastic/multiprocessing/api.py:1002] failed (exitcode: -9) local_rank: 1 (pid: 4194001) of binary: python
Failures:
[1]:
  rank      : 0 (local_rank: 0)
  exitcode  : -15 (pid: 4194000)  (SIGTERM)
Root Cause (first observed failure):
[0]:
  rank      : 1 (local_rank: 1)
  exitcode  : -9 (pid: 4194001)  (SIGKILL)
"""  # noqa: E501


def killed_in_teardown(logs: Path, rank0_finished: bool = True, rank0_exit: bool = False) -> None:
    """Both ranks train to step 23, rank 0 saves the final checkpoint; rank 1 logs its exit line
    and is then SIGKILLed; torchrun SIGTERMs rank 0 in its teardown: after its TRAINING_FINISHED
    line (`rank0_finished`; else before it, drawing the loss curve), and after its exit line
    (`rank0_exit`), with no stop line of its own."""
    write_train_log(logs, 2)
    w0, w1 = RankWriter(logs, 0, 2), RankWriter(logs, 1, 2)
    for w in (w0, w1):
        w.start()
        w.epoch(0, 1, 23)
        w.log(CHECKPOINT_START.format(step=23, reason="final", path=CKPT))
        w.log(CHECKPOINT_END.format(step=23, reason="final", path=CKPT, size="225.6 KB",
                                    seconds=0.01))  # fmt: skip
        # the last validation's best.ckpt, saved after the step file: not the one to name
        best = BEST_SAVE.format(value=0.0123)
        w.log(CHECKPOINT_START.format(step=23, reason=best, path=BEST))
        w.log(CHECKPOINT_END.format(step=23, reason=best, path=BEST, size="225.6 KB",
                                    seconds=0.01))  # fmt: skip
        w.log("========== SAMPLING START ========== step 23")
        w.log("========== SAMPLING END ========== step 23")
    w1.log(TRAINING_FINISHED.format(step=23, limit=" (--max_epochs=1 reached)"))
    w1.exit()
    w0.log("`Trainer.fit` stopped: `max_epochs=1` reached.")
    if rank0_finished:
        w0.log(TRAINING_FINISHED.format(step=23, limit=" (--max_epochs=1 reached)"))
    if rank0_exit:
        w0.exit()
    for w in (w0, w1):
        w.flush()
    (logs / LAUNCHER_LOG_FILE.format(ts=TS)).write_text(REPORT)


@pytest.mark.parametrize(
    "rank0_finished, rank0_exit",
    [(True, False), (False, False), (True, True)],
    ids=["rank0_finished", "rank0_before_its_line", "both_exit_lines"],
)
def test_a_rank_killed_in_teardown_leaves_a_finished_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], rank0_finished: bool, rank0_exit: bool
) -> None:
    """Was: `held back by rank 0: killed without trace (phase training step)` (rank 0 has no
    exit line), or FINISHED with no word of the kill (both exit lines)."""
    killed_in_teardown(tmp_path, rank0_finished, rank0_exit)
    doc = diagnose(find_run(tmp_path))
    assert doc["status"] == "finished"
    assert doc["culprits"] == [] and doc["victims"] == []
    assert [(r["rank"], r["state"], r["phase"]) for r in doc["ranks"]] == [
        (0, "stopped", "teardown"),
        (1, "killed", "teardown"),
    ]
    ends = [(f["rank"], f["phase"], f["cause"]) for f in doc["teardown"]]
    assert ends == [(1, "teardown", "killed (SIGKILL)"), (0, "teardown", "killed (SIGTERM)")]
    assert doc["teardown"][0]["evidence"][-1]["text"] == "exitcode  : -9 (pid: 4194001)  (SIGKILL)"
    assert doc["training_finished"]["step"] == 23 and doc["training_finished"]["checkpoint"] == CKPT
    head = verdict_lines(doc)[0]  # the launcher's console says the same
    assert head.startswith(
        f"Training finished at step 23, its checkpoints complete ({CKPT}); rank 1 was then "
        "killed (SIGKILL) in teardown, then rank 0 killed (SIGTERM)"
    )
    assert head.endswith("; nothing to redo")
    assert ("loss curve" in head) is not rank0_finished  # rank 0's own end not reached
    render(doc, Console(width=400))
    out = capsys.readouterr().out
    assert ": 2 ranks, FINISHED;" in out and f"Verdict: {head}." in out
    assert "held back" not in out and "training step" not in out


def test_a_kill_in_training_is_still_a_failure(tmp_path: Path) -> None:
    """The same kill before any rank's TRAINING_FINISHED line: rank 1 is the culprit."""
    killed_in_teardown(tmp_path, rank0_finished=False)
    path = tmp_path / f"debug_rank1_{TS}.log"
    path.write_text("\n".join(path.read_text().splitlines()[:-2]) + "\n")  # no finish, no exit
    doc = diagnose(find_run(tmp_path))
    assert doc["status"] == "failed" and doc["teardown"] == []
    assert [(c["rank"], c["cause"]) for c in doc["culprits"]] == [(1, "killed (SIGKILL)")]


def test_a_victims_phase_is_the_one_its_stop_line_names(tmp_path: Path) -> None:
    """Was: `rank 0: stopped by SIGTERM (phase training step)` quoting `... in phase teardown`."""
    killed_in_teardown(tmp_path, rank0_finished=False)
    path = tmp_path / f"debug_rank1_{TS}.log"
    path.write_text("\n".join(path.read_text().splitlines()[:-2]) + "\n")
    w0 = RankWriter(tmp_path, 0, 2, t=T0 + 60)  # after its other lines
    w0.log(STOP_SIGNAL.format(signal="SIGTERM", phase="teardown", step=23), "WARNING")
    w0.flush()
    # its process gone, its last beat from training
    write_heartbeat(tmp_path, 0, 2, pid=dead_pid(), t=T0 + 1, phase="training step", step=23)
    doc = diagnose(find_run(tmp_path))
    assert [(v["rank"], v["phase"], v["cause"]) for v in doc["victims"]] == [
        (0, "teardown", "stopped by SIGTERM")
    ]
