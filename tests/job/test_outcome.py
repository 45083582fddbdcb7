"""What the launcher says when a run fails or is stopped, from the run's logs (synthetic, in the
real line formats): the verdict, a user error's one message, the checkpoint after a stop."""

from __future__ import annotations

import re
import signal
from pathlib import Path

import pytest

from ae.diagnose.report import TEXT_LIMIT
from ae.job.outcome import report_failure, report_stop
from ae.log_lines import (
    LAUNCHER_LOG_FILE,
    NONFINITE,
    NONFINITE_RECEIVED,
    PREEMPTED,
    STOP_SIGNAL_STUCK,
    STUCK_MAIN_THREAD,
    TRAIN_LOG_FILE,
)
from bench.synthetic_logs import T0, TS, RankWriter, record, write_heartbeat, write_train_log


def two_ranks(logs: Path) -> tuple[RankWriter, RankWriter]:
    write_train_log(logs, 2)
    w0, w1 = RankWriter(logs, 0, 2), RankWriter(logs, 1, 2)
    for w in (w0, w1):
        w.start()
        w.log("========== EPOCH 0 TRAINING START ==========")
        w.steps(1, 3)
    return w0, w1


def test_a_failure_prints_the_verdict(tmp_path: Path, said: list[str]) -> None:
    w0, w1 = two_ranks(tmp_path)
    frames = [("/x/model.py", "training_step")]
    w1.fatal("InjectedFault", "raise fault injected by AE_FAULT", frames)
    w0.log("Stop signal SIGTERM received in phase training step at step 3", "WARNING")
    for w in (w0, w1):
        w.flush()
    (tmp_path / LAUNCHER_LOG_FILE.format(ts=TS)).write_text("ChildFailedError: ...\n")
    assert report_failure(tmp_path, TS, 1) == 1
    verdict, more = said
    assert verdict.startswith(
        "Training failed: rank 1 on node0, phase training step: exception: In"
    )
    assert f"debug_rank1_{TS}.log:" in verdict
    assert "FATAL uncaught exception InjectedFault" in verdict
    assert more == (
        f"More: ae-diagnose {tmp_path} --run {TS}  (torchrun's own report: "
        f"{tmp_path / LAUNCHER_LOG_FILE.format(ts=TS)})"
    )


def test_a_user_error_in_a_rank_is_one_message(tmp_path: Path, said: list[str]) -> None:
    """Rank 1's message (rank 0's own is on the console already, said by rank 0)."""
    w0, w1 = two_ranks(tmp_path)
    w1.log("1 problem in the configuration:", "ERROR")
    w1.raw("  - precision: bf16-mixed needs a GPU with bfloat16")
    w1.exit(2, "ConfigError")
    w0.log("train_shards: no readable sample in 2 shards", "ERROR")
    w0.exit(2, "DataError")
    for w in (w0, w1):
        w.flush()
    # Rank 0 said its own; the relay (ae.job.rank_lines) said rank 1's only in part (a record
    # past RECORD_LINES, not among the messages it said whole): rank 1's is said again, whole.
    whole = "1 problem in the configuration:\n  - precision: bf16-mixed needs a GPU with bfloat16"
    more = f"More: ae-diagnose {tmp_path} --run {TS}"
    rank0 = "train_shards: no readable sample in 2 shards"
    assert report_failure(tmp_path, TS, 1, said={rank0}) == 2
    assert said == [whole, more]
    said.clear()
    assert report_failure(tmp_path, TS, 1, said={rank0, whole}) == 2  # the relay said it whole
    assert said == [more]


def test_rank_0s_message_buried_by_relayed_lines_is_said_again_last(
    tmp_path: Path, said: list[str]
) -> None:
    """Rank 0 stopped on bad data; its workers' `Bad sample` lines, held by the relay, came out
    after rank 0's message: the console's last lines were bad samples and `More:`. The relay
    no longer counts rank 0's message as said (`RankLines.last_words_said`): it is said again,
    last; with no relay (None) rank 0's own console said it."""
    w0, w1 = two_ranks(tmp_path)
    rank0 = "train_shards: more than --max_bad_fraction=0.01 of epoch 0's samples were bad"
    for w in (w0, w1):
        w.log(rank0, "ERROR")
        w.exit(2, "DataError")
        w.flush()
    more = f"More: ae-diagnose {tmp_path} --run {TS}"
    assert report_failure(tmp_path, TS, 1, said=set()) == 2
    assert said == [rank0, more]
    said.clear()
    assert report_failure(tmp_path, TS, 1) == 2
    assert said == [more]


def test_a_nonfinite_stop_is_said_once_whole_then_more(tmp_path: Path, said: list[str]) -> None:
    """`--on_nonfinite=stop`: rank 1's NONFINITE line (longer than the JSON keeps of a line) and
    the error every rank raised. The relay said the one, rank 0 the other: nothing of them twice,
    and the `ae-diagnose` command as after any failure. A console that said neither (another
    node's launcher) gets each once, whole."""
    w0, w1 = two_ranks(tmp_path)
    keys = ", ".join(f"{k:024d}" for k in range(16))
    nonfinite = NONFINITE.format(value="loss=nan", rank=1, step=4, epoch=0, batch="3",
                                 samples=f"shard /data/vec/train-000000.tar, keys [{keys}, ... 16 "
                                 "more]")  # fmt: skip
    assert len(nonfinite) > TEXT_LIMIT
    error = "non-finite value at step 4 (--on_nonfinite=stop): the NONFINITE line names ..."
    w1.log(nonfinite, "ERROR")
    w0.log(NONFINITE_RECEIVED.format(step=4), "WARNING")
    for w in (w0, w1):
        w.log(error, "ERROR")
        w.exit(2, "NonFiniteError")
        w.flush()
    more = f"More: ae-diagnose {tmp_path} --run {TS}"
    assert report_failure(tmp_path, TS, 1, said={nonfinite, error}) == 2
    assert said == [more]
    said.clear()
    assert report_failure(tmp_path, TS, 1, said={error}) == 2
    assert said == [nonfinite, more]


def test_no_rank_log_shows_the_end_of_torchruns_report(tmp_path: Path, said: list[str]) -> None:
    report = [f"line {i}" for i in range(20)] + ["torch.distributed.DistNetworkError: port in use"]
    (tmp_path / LAUNCHER_LOG_FILE.format(ts=TS)).write_text("\n".join(report) + "\n")
    assert report_failure(tmp_path, TS, 1) == 1
    assert said[0].startswith("Training failed (exit 1) before any rank wrote a log.")
    assert said[0].endswith("    line 19\n    torch.distributed.DistNetworkError: port in use")


@pytest.mark.parametrize(("sig", "code", "what"), [
    (signal.SIGINT, 130, "Interrupted"), (signal.SIGTERM, 143, "Preempted (SIGTERM)"),
])  # fmt: skip
def test_a_stop_names_the_checkpoint(
    tmp_path: Path, said: list[str], sig: signal.Signals, code: int, what: str
) -> None:
    ckpt = tmp_path / "checkpoints" / "step-00000012.ckpt"
    line = PREEMPTED.format(signal=sig.name, step=12, path=ckpt, lr="0.001")
    (tmp_path / TRAIN_LOG_FILE.format(ts=TS)).write_text(record(T0, "WARNING", 0, 2, line) + "\n")
    assert report_stop(tmp_path, TS, sig, killed=False, newest=None) == code
    assert said == [
        f"{what} at step 12; checkpoint saved at {ckpt}; resume with --resume_from_checkpoint=last"
    ]
    said.clear()
    assert report_stop(tmp_path, TS, sig, killed=True, newest=None) == code
    # The second Ctrl-C came after the save: the one line says both, never "without a checkpoint"
    assert said == [
        f"{what} at step 12; checkpoint saved at {ckpt}, then stopped at once (second Ctrl-C); "
        "resume with --resume_from_checkpoint=last"
    ]
    said.clear()
    (tmp_path / TRAIN_LOG_FILE.format(ts=TS)).write_text("")  # before any save
    older = tmp_path / "checkpoints" / "step-00000008.ckpt"
    assert report_stop(tmp_path, TS, sig, killed=True, newest=(8, older)) == code
    assert said[0].endswith(
        "stopped at once (second Ctrl-C), without a checkpoint of this moment; resume with "
        f"--resume_from_checkpoint=last continues from step 8 ({older})"
    )
    # Was: "... continues from the newest one saved" when there was none
    said.clear()
    for killed in (True, False):
        assert report_stop(tmp_path, TS, sig, killed=killed, newest=None) == code
        assert said.pop().endswith(
            "no checkpoint to resume from: --resume_from_checkpoint=last starts from scratch"
        )


def test_a_hang_stopped_says_which_rank_held_it_back(tmp_path: Path, said: list[str]) -> None:
    """Ctrl-C on a run that hung 40 s before any STALL report: the ranks leave without a save,
    and the console names the rank the stop signal found stuck in its own work (was only
    "Interrupted before the ranks saved a checkpoint"), then the resume advice, last."""
    from tests.diagnose.synthetic_runs import dead_pid

    w0, w1 = two_ranks(tmp_path)
    doing = {1: "code: _injected_sleep (ae/forensics/faults.py:229)",
             0: "collective: DDP gradient all-reduce in backward"}  # fmt: skip
    for w in (w1, w0):
        w.t += 40
        line = STOP_SIGNAL_STUCK.format(signal="SIGINT", idle=40, phase="training step", step=3)
        w.log(line + STUCK_MAIN_THREAD.format(doing=doing[w.rank]), "WARNING")
        w.flush()
        write_heartbeat(tmp_path, w.rank, 2, pid=dead_pid(), t=w.t, phase="training step", step=3)
    older = tmp_path / "checkpoints" / "step-00000002.ckpt"
    assert report_stop(tmp_path, TS, signal.SIGINT, killed=False, newest=(2, older)) == 130
    stuck, more, last = said
    head = stuck.splitlines()[0]
    assert re.fullmatch(
        r"The job was stuck when stopped: rank 1 on \S+, phase training step: training step \(no "
        r"progress for 40s when SIGINT came, main thread in code: _injected_sleep \(ae/forensics/"
        r"faults\.py:229\)\)",
        head,
    ), head
    assert "rank 0" not in stuck
    assert more == f"More: ae-diagnose {tmp_path} --run {TS}"
    assert last.startswith("Interrupted before the ranks saved a checkpoint")


def test_a_rank_gone_without_trace_under_a_stop_is_no_hang(tmp_path: Path, said: list[str]) -> None:
    """Rank 1's log just stops (SIGKILLed), rank 0 leaves on the stop signal: the verdict names
    rank 1 `killed without trace`, which is no hang to report as one (seen, SLURM's requeue
    signalling torchrun twice: 'The job was stuck when stopped: ... killed without trace')."""
    from tests.diagnose.synthetic_runs import dead_pid

    w0, w1 = two_ranks(tmp_path)
    w0.t += 20
    line = STOP_SIGNAL_STUCK.format(signal="SIGTERM", idle=20, phase="training step", step=3)
    w0.log(line + STUCK_MAIN_THREAD.format(doing="collective: all_reduce"), "WARNING")
    for w in (w0, w1):
        w.flush()
        write_heartbeat(tmp_path, w.rank, 2, pid=dead_pid(), t=w.t, phase="training step", step=3)
    assert report_stop(tmp_path, TS, signal.SIGTERM, killed=False, newest=None) == 143
    assert len(said) == 1 and said[0].startswith("Preempted (SIGTERM) before the ranks saved"), said


def test_a_training_failure_says_the_way_on(tmp_path: Path, said: list[str]) -> None:
    """Was: the verdict and the ae-diagnose command alone, nothing of how to go on (exit 1 is a
    failure a resume can take up: docs/RUNS.md)."""
    w0, w1 = two_ranks(tmp_path)
    w1.fatal("InjectedFault", "raise fault injected by AE_FAULT", [("/x/model.py", "step")])
    for w in (w0, w1):
        w.flush()
    ckpt = tmp_path / "checkpoints" / "step-00000008.ckpt"
    assert report_failure(tmp_path, TS, 1, newest=(8, ckpt), resumable=True) == 1
    verdict, way_on, more = said
    assert verdict.startswith("Training failed: rank 1 on node0")
    assert way_on == (
        "Once its cause is fixed, or to try again: resume with --resume_from_checkpoint=last "
        f"continues from step 8 ({ckpt})"
    )
    assert more.startswith("More: ae-diagnose")  # still the last words
    said.clear()
    report_failure(tmp_path, TS, 1, resumable=True)  # failed before its first checkpoint
    assert said[1] == (
        "Once its cause is fixed, or to try again: no checkpoint to resume from: "
        "--resume_from_checkpoint=last starts from scratch"
    )
