"""The restart decisions of `--max_restarts`, from the logs of failed attempts (synthetic, in the
real line formats): the RESTART line, the stop rules, the checkpoint `last` names, and the
attempts ae-diagnose lists."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from ae.diagnose.attempts import diagnose_job
from ae.diagnose.cli import main
from ae.diagnose.log_files import find_run
from ae.errors import UserError
from ae.job.rank_env import restart_checkpoint
from ae.job.restarts import (
    SAME_FAILURE_EXIT,
    Restart,
    Restarts,
    newest_checkpoint,
    resume_note,
)
from ae.log_lines import RESTART, TRAIN_LOG_FILE
from bench.synthetic_logs import T0, RankWriter, record, write_train_log

TS1, TS2, TS3 = "20261121_120000", "20261121_120100", "20261121_120200"


def failed_attempt(logs: Path, ts: str, step: int, exc: str = "InjectedFault") -> None:
    """Rank 1 raises `exc` at `step`; rank 0 is stopped by torchrun."""
    write_train_log(logs, 2, ts=ts)
    w0, w1 = RankWriter(logs, 0, 2, ts=ts), RankWriter(logs, 1, 2, ts=ts)
    for w in (w0, w1):
        w.start(host=f"node{w.rank}")
        w.log("========== EPOCH 0 TRAINING START ==========")
        w.steps(1, step)
    w1.fatal(exc, "boom", [("/x/model.py", "training_step")])
    w0.log(f"Stop signal SIGTERM received in phase training step at step {step}", "WARNING")
    for w in (w0, w1):
        w.flush()


def checkpoints(folder: Path, *steps: int) -> Path:
    """Step files, `last.ckpt` a hard link to the newest (as ae.training writes them)."""
    folder.mkdir(parents=True, exist_ok=True)
    for step in steps:
        (folder / f"step-{step:08d}.ckpt").write_bytes(b"x")
    os.link(folder / f"step-{steps[-1]:08d}.ckpt", folder / "last.ckpt")
    return folder


def test_a_failure_restarts_from_the_newest_checkpoint(tmp_path: Path) -> None:
    logs, ckpts = tmp_path / "logs", checkpoints(tmp_path / "checkpoints", 4, 8)
    os.link(ckpts / "step-00000004.ckpt", ckpts / "best.ckpt")  # not what last names
    failed_attempt(logs, TS1, 11)
    nxt = Restarts(3, logs, ckpts).after_failure(TS1, 1)
    assert isinstance(nxt, Restart)
    assert nxt.args == ["--resume_from_checkpoint=last", "--overwrite=false"]
    line = RESTART.parse(nxt.line)
    assert line is not None and nxt.line.startswith("RESTART 1/3 after rank 1 on node1, phase ")
    assert line["failed"].endswith("exception: InjectedFault")
    assert (line["step"], line["resume"], line["redone"]) == ("11", "8", "3")
    assert line["checkpoint"] == str(ckpts / "step-00000008.ckpt") and line["previous"] == TS1
    assert restart_checkpoint(nxt.line) == str(ckpts / "step-00000008.ckpt")  # the rank's check


def test_without_a_checkpoint_the_restart_starts_as_the_first_attempt(tmp_path: Path) -> None:
    logs = tmp_path / "logs"
    failed_attempt(logs, TS1, 2)
    nxt = Restarts(1, logs, tmp_path / "checkpoints").after_failure(TS1, 1)
    assert isinstance(nxt, Restart) and nxt.args == []
    assert "resuming from step 0 (as the first attempt did), 2 steps redone" in nxt.line
    assert restart_checkpoint(nxt.line) is None and restart_checkpoint(None) is None


def test_the_same_failure_twice_stops_another_goes_on(tmp_path: Path) -> None:
    logs, ckpts = tmp_path / "logs", checkpoints(tmp_path / "checkpoints", 4)
    restarts = Restarts(5, logs, ckpts)
    failed_attempt(logs, TS1, 6)
    assert isinstance(restarts.after_failure(TS1, 1), Restart)
    failed_attempt(logs, TS2, 7)  # another step: not the same failure
    assert isinstance(restarts.after_failure(TS2, 1), Restart)
    failed_attempt(logs, TS3, 7)
    assert restarts.after_failure(TS3, 1) == SAME_FAILURE_EXIT


def test_restarts_used_up_and_a_user_error_end_the_job(tmp_path: Path) -> None:
    logs, ckpts = tmp_path / "logs", checkpoints(tmp_path / "checkpoints", 4)
    restarts = Restarts(1, logs, ckpts)
    failed_attempt(logs, TS1, 6, "ValueError")
    assert isinstance(restarts.after_failure(TS1, 1), Restart)
    failed_attempt(logs, TS2, 9)
    assert restarts.after_failure(TS2, 1) is None  # the caller reports the failure

    logs = tmp_path / "user"
    write_train_log(logs, 1, ts=TS1)
    w = RankWriter(logs, 0, 1, ts=TS1)
    w.start()
    w.log("val_shards: no readable sample", "ERROR")
    w.exit(UserError.exit_code, "DataError")
    w.flush()
    assert Restarts(3, logs, ckpts).after_failure(TS1, 1) is None


def test_a_non_finite_stop_is_no_restart_and_is_said_as_such(tmp_path: Path) -> None:
    # Was: `Not restarting: a user error (exit 2 from a rank)`, for a NaN that no command caused
    logs, ckpts = tmp_path / "logs", checkpoints(tmp_path / "checkpoints", 5)
    write_train_log(logs, 2, ts=TS1)
    w0, w1 = RankWriter(logs, 0, 2, ts=TS1), RankWriter(logs, 1, 2, ts=TS1)
    for w in (w0, w1):
        w.start()
        w.steps(1, 7)
    w1.nonfinite(8, "/d/a-000000.tar", peers=(w0,))
    for w in (w0, w1):
        w.exit(UserError.exit_code, "NonFiniteError")
        w.flush()
    restarts = Restarts(3, logs, ckpts)
    assert restarts.after_failure(TS1, 1) is None
    assert restarts.said == (
        "Not restarting: the run stopped on a non-finite loss=nan at step 8, which a restart "
        "would meet again (exit 2 from a rank)"
    )


def test_newest_checkpoint_follows_last(tmp_path: Path) -> None:
    assert newest_checkpoint(tmp_path) is None
    ckpts = checkpoints(tmp_path / "c", 4, 8)
    (ckpts / "step-00000012.ckpt").write_bytes(b"x")  # newer, but not (yet) what last names
    assert newest_checkpoint(ckpts) == (8, ckpts / "step-00000008.ckpt")


def test_a_resume_by_hand_says_the_steps_it_trains_again(tmp_path: Path) -> None:
    # Was: after a run killed at step 11 (its last save at 8), `--resume_from_checkpoint=last`
    # said where it started, and nothing of the 3 steps redone (found by the overnight
    # walkthrough); a RESTART line says them
    logs, ckpts = tmp_path / "logs", checkpoints(tmp_path / "checkpoints", 4, 8)
    (ckpts / "best.ckpt").write_bytes(b"x")  # a file of its own, as the trainer writes it
    failed_attempt(logs, TS1, 11)
    said = (
        f"Resuming at step 8 ({ckpts / 'step-00000008.ckpt'}): the previous run, {TS1}, reached "
        "step 11; steps 9-11 are trained again (3 steps redone)"
    )
    assert resume_note(ckpts, "last", logs, TS2) == said
    # A run refused before its first step (another --latent_dim) in between says nothing
    write_train_log(logs, 1, ts=TS2)
    refused = RankWriter(logs, 0, 1, ts=TS2)
    refused.start()
    refused.exit(UserError.exit_code, "ResumeRefused")
    refused.flush()
    assert resume_note(ckpts, "last", logs, TS3) == said
    assert resume_note(ckpts, str(ckpts / "step-00000008.ckpt"), logs, TS2) == said
    assert "at step 4 " in (resume_note(ckpts, str(ckpts / "step-00000004.ckpt"), logs, TS2) or "")
    # One step: was `steps 11-11 are trained again (1 steps redone)`
    (ckpts / "step-00000010.ckpt").write_bytes(b"x")
    one = resume_note(ckpts, str(ckpts / "step-00000010.ckpt"), logs, TS2) or ""
    assert one.endswith("reached step 11; step 11 is trained again (1 step redone)")
    (ckpts / "step-00000010.ckpt").unlink()
    # Nothing to say: no resume, best.ckpt (its step is not in its name), no earlier run, a
    # checkpoint at the step the run reached (a stop signal saves where it stops)
    assert resume_note(ckpts, None, logs, TS2) is None
    assert resume_note(ckpts, str(ckpts / "best.ckpt"), logs, TS2) is None
    assert resume_note(ckpts, "last", logs, TS1) is None
    (ckpts / "step-00000011.ckpt").write_bytes(b"x")
    assert resume_note(ckpts, str(ckpts / "step-00000011.ckpt"), logs, TS2) is None


def test_ae_diagnose_lists_the_attempts_of_a_job_from_any_of_them(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    logs, ckpts = tmp_path / "logs", checkpoints(tmp_path / "checkpoints", 4)
    restarts = Restarts(2, logs, ckpts)
    failed_attempt(logs, TS1, 6)
    nxt = restarts.after_failure(TS1, 1)
    assert isinstance(nxt, Restart)
    # the second attempt: its rank 0 writes the RESTART line first, then trains to the end
    write_train_log(logs, 2, ts=TS2)
    with open(logs / TRAIN_LOG_FILE.format(ts=TS2), "a") as f:
        f.write(record(T0 + 60, "WARNING", 0, 2, nxt.line) + "\n")
    for rank in (0, 1):
        w = RankWriter(logs, rank, 2, ts=TS2, t=T0 + 60)
        w.start()
        w.steps(5, 12)
        w.exit()
        w.flush()
    failed_attempt(logs, "20261121_130000", 3)  # another job in the same folder
    for ts in (TS1, TS2):
        found = diagnose_job(find_run(logs, ts))["attempts"]
        assert [(a["attempt"], a["run"]) for a in found] == [(0, TS1), (1, TS2)]
        assert found[0]["verdict"].startswith("rank 1 on node1, phase ")
        assert found[0]["restart"] is None and found[1]["restart"] == nxt.line
        assert found[1]["status"] == "finished"
    assert main([str(logs), "--run", TS1]) == 0
    table = capsys.readouterr().out
    assert "Attempts of this job: 2" in table and f"1  run {TS2}  finished\n" in table
    assert f"0  run {TS1}  failed: rank 1 on node1, phase " in table


def test_a_kill_between_step_lines_is_placed_at_the_newest_step_any_rank_shows(
    tmp_path: Path,
) -> None:
    """Rank 1 SIGKILLed at step 125 (checkpoints every 40): its last step line says 93, its
    checkpoint lines 120; rank 0 got torchrun's SIGTERM at step 125. The RESTART line says the
    kill came at step 125, resuming from 120: 5 steps redone (not `at step 93 ... 0 redone`)."""
    logs, ckpts = tmp_path / "logs", checkpoints(tmp_path / "checkpoints", 40, 80, 120)
    write_train_log(logs, 2, ts=TS1)
    w0, w1 = RankWriter(logs, 0, 2, ts=TS1), RankWriter(logs, 1, 2, ts=TS1)
    for w in (w0, w1):
        w.start()
        w.log("========== EPOCH 1 TRAINING START ==========")
        w.steps(91, 93)  # the step lines come every few batches
        path = ckpts / "step-00000120.ckpt"
        w.log(f"========== CHECKPOINT SAVE START ========== step 120 (periodic) -> {path}")
        w.log(f"========== CHECKPOINT SAVE END ========== step 120 (periodic): {path}, 1 KB, 0.01s")
    w0.log("Stop signal SIGTERM received in phase training step at step 125", "WARNING", dt=1.0)
    for w in (w0, w1):
        w.flush()
    report = ["Root Cause (first observed failure):", "[0]:", "  rank      : 1 (local_rank: 1)",
              "  exitcode  : -9 (pid: 4194001)  (SIGKILL)"]  # fmt: skip
    (logs / f"launcher_{TS1}.log").write_text("\n".join(report) + "\n")
    nxt = Restarts(1, logs, ckpts).after_failure(TS1, 1)
    assert isinstance(nxt, Restart)
    line = RESTART.parse(nxt.line)
    assert line is not None and line["failed"].endswith("killed (SIGKILL)"), nxt.line
    assert (line["step"], line["resume"], line["redone"]) == ("125", "120", "5"), nxt.line


def test_a_rank_killed_after_training_finished_is_no_restart(
    tmp_path: Path, said: list[str]
) -> None:
    """Rank 1 killed (SIGKILL) after its exit line, rank 0 SIGTERMed by torchrun in teardown
    after training finished: the job is done. Was: `RESTART 1/1 after rank 0 ..., phase
    training step: killed without trace`; without --max_restarts: `Training failed`, exit 1."""
    from ae.config import parse_config
    from ae.job import launch
    from ae.job.supervise import Stops
    from ae.job.topology import Topology
    from tests.diagnose.test_teardown import killed_in_teardown

    cfg = parse_config([f"--output_dir={tmp_path}"])
    logs = cfg.run.dir.logs
    killed_in_teardown(logs)
    restarts = Restarts(1, logs, checkpoints(tmp_path / "checkpoints", 23))
    assert restarts.after_failure(TS1, 1) == 0 and restarts.failed == []
    assert said[-1].startswith("Training finished at step 23, its checkpoints complete")
    topo = Topology(nnodes=1, node_rank=0, master_addr="127.0.0.1", master_port=None, job="j")
    assert launch.ending(cfg, topo, TS1, 1, Stops()) is None  # exit 0, not a failure
    assert said[-2].startswith("Training finished at step 23") and said[-1].startswith("Done.")
