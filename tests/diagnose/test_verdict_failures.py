"""ae-diagnose verdict rules for ranks that failed with a trace: an exception, a fatal signal,
an error exit, and which failure is a peer's (the culprit, its victims), on synthetic logs
written with the real line formats (bench/synthetic_logs.py); a clean or signal-stopped run
has no culprit."""

from __future__ import annotations

from pathlib import Path

import pytest
from rich.console import Console

from ae.diagnose.report import render
from ae.log_lines import LAUNCHER_GONE, LAUNCHER_LOG_FILE, PREEMPTED, RANK_LAUNCHER_GONE
from bench.synthetic_logs import TS, write_heartbeat
from tests.diagnose.synthetic_runs import (
    BACKWARD_FRAMES,
    GLOO,
    SEGV_FRAMES,
    STEP_FRAMES,
    culprits,
    dead_pid,
    run_diagnose,
    writers,
)


def test_clean_run_has_no_culprit(tmp_path: Path) -> None:
    for w in writers(tmp_path):
        w.epoch(0, 1, 15)
        w.epoch(1, 16, 30)
        w.exit()
        w.flush()
    doc = run_diagnose(tmp_path)
    assert doc["culprits"] == [] and doc["victims"] == [] and doc["status"] == "finished"
    assert doc["stopped_by"] is None
    assert [(r["rank"], r["state"], r["step"]) for r in doc["ranks"]] == [
        (0, "exited", 30),
        (1, "exited", 30),
    ]
    assert doc["ranks"][0]["last_marker"] == "EPOCH 1 VALIDATION END"
    assert doc["ranks"][0]["memory"] == "rss=400MB workers=1x300MB"


def test_a_run_stopped_by_a_signal_after_its_save_is_stopped_not_finished(tmp_path, capsys):
    """Ctrl-C, scancel, a preemption: every rank saves and exits 0, but training did not end."""
    ckpt = "/runs/ae/checkpoints/step-00000020.ckpt"
    for w in writers(tmp_path):
        w.epoch(0, 1, 15)
        w.steps(16, 20, epoch=1)
        w.log(PREEMPTED.format(signal="SIGINT", step=20, path=ckpt, lr=0.001), "WARNING")
        w.exit(why="preempted at step 20; resume with --resume_from_checkpoint=last")
        w.flush()
    doc = run_diagnose(tmp_path)
    assert doc["status"] == "stopped" and doc["culprits"] == []
    assert doc["stopped_by"] == {
        "signal": "SIGINT",
        "step": 20,
        "checkpoint": ckpt,
        "launcher_gone": None,
    }
    render(doc, Console(width=300))
    said = capsys.readouterr().out
    assert ": 2 ranks, STOPPED;" in said
    assert f"(stopped by SIGINT at step 20; checkpoint {ckpt} saved; resume with" in said


# What the launcher log holds when the launcher died: torchrun's words and its wrapper's line;
# or, for the one rank of a one-process job, which the launcher started itself, the rank's line
TORCHRUN_TOLD = (
    "W1128 04:35:40.452000 17339 api.py:753] Received 15 death signal, shutting down workers\n"
    "torch.distributed.elastic.multiprocessing.api.SignalException: Process 17339 got "
    "signal: 15\n" + LAUNCHER_GONE.format(pid=17336) + "\n"
)
RANK_TOLD = RANK_LAUNCHER_GONE.format(pid=17336, rank=0) + "\n"


@pytest.mark.parametrize(("world", "told"), [(2, TORCHRUN_TOLD), (1, RANK_TOLD)])
def test_a_run_stopped_as_its_launcher_died_says_so(tmp_path, capsys, world, told):
    """The launcher killed (`kill -9`, a closed terminal): the kernel's SIGTERM to torchrun,
    passed on, stopped the ranks (or, with no torchrun, the kernel's SIGTERM to the rank). Was:
    `stopped by SIGTERM`, which no one had sent."""
    ckpt = "/runs/ae/checkpoints/step-00000020.ckpt"
    for w in writers(tmp_path, world):
        w.steps(1, 20)
        w.log(PREEMPTED.format(signal="SIGTERM", step=20, path=ckpt, lr=0.001), "WARNING")
        w.exit(why="preempted at step 20; resume with --resume_from_checkpoint=last")
        w.flush()
    (tmp_path / LAUNCHER_LOG_FILE.format(ts=TS)).write_text(told)
    doc = run_diagnose(tmp_path)
    assert doc["status"] == "stopped" and doc["culprits"] == []
    assert doc["stopped_by"]["launcher_gone"] == 17336
    render(doc, Console(width=300))
    assert (
        f"(stopped by SIGTERM at step 20, sent as its launcher (pid 17336) died; checkpoint "
        f"{ckpt} saved;"
    ) in capsys.readouterr().out


def test_a_user_error_on_every_rank_is_said_as_such(tmp_path, capsys):
    """A refused resume (another --latent_dim): every rank says why and exits 2. Was: `Verdict:
    held back by rank 0, 1`, of ranks that held nothing back."""
    for w in writers(tmp_path):
        w.log("resume_from_checkpoint: /r/last.ckpt holds another model than these flags build",
              "ERROR")  # fmt: skip
        w.exit(2, "ResumeRefused")
        w.flush()
    doc = run_diagnose(tmp_path)
    assert [c["rank"] for c in doc["culprits"]] == [0, 1]
    render(doc, Console(width=300))
    said = capsys.readouterr().out
    assert (
        "Verdict: stopped by a user error (exit 2: its message says what to change) on rank 0, 1"
    ) in said
    assert "held back" not in said


def test_exception_is_the_culprit_and_the_peer_failure_a_victim(tmp_path: Path) -> None:
    w0, w1 = writers(tmp_path)
    for w in (w0, w1):
        w.log("========== EPOCH 0 TRAINING START ==========")
        w.steps(1, 3)
    w1.fatal("ValueError", "bad value", STEP_FRAMES)
    w0.t = w1.t + 0.5
    w0.fatal("RuntimeError", GLOO, BACKWARD_FRAMES)
    for w in (w0, w1):
        w.flush()
    doc = run_diagnose(tmp_path)
    assert culprits(doc) == [(1, "training step", "exception: ValueError")]
    (culprit,) = doc["culprits"]
    texts = [e["text"] for e in culprit["evidence"]]
    assert "FATAL uncaught exception ValueError" in texts[0]
    assert any("in training_step" in t for t in texts) and texts[-1] == "ValueError: bad value"
    assert culprit["evidence"][0]["file"].startswith("debug_rank1_")
    assert culprit["evidence"][0]["line"] == 9  # 2 header lines, 2 plans, marker, 3 steps, FATAL
    assert [(v["rank"], v["cause"]) for v in doc["victims"]] == [(0, "peer failure: RuntimeError")]
    assert doc["status"] == "failed"


def test_exception_in_a_dataloader_worker_is_data_loading(tmp_path: Path) -> None:
    w0, w1 = writers(tmp_path)
    frames = [("/x/torch/utils/data/_utils/worker.py", "_worker_loop"),
              ("/x/ae/data/shards/tar_samples.py", "read_slices")]  # fmt: skip
    w0.fatal("OSError", "truncated tar", frames, where="dataloader worker 1/2", worker="1/2")
    w0.fatal("OSError", "Caught OSError in DataLoader worker process 1", frames)
    w0.flush()
    w1.flush()
    assert culprits(run_diagnose(tmp_path)) == [(0, "data loading", "exception: OSError")]


def test_fatal_signal(tmp_path: Path) -> None:
    w0, w1 = writers(tmp_path)
    w1.log("========== EPOCH 0 TRAINING START ==========")
    w1.segfault(SEGV_FRAMES)
    w0.fatal("RuntimeError", GLOO, BACKWARD_FRAMES)
    w0.flush()
    w1.flush()
    doc = run_diagnose(tmp_path)
    assert culprits(doc) == [(1, "training step", "fatal signal: SIGSEGV")]
    assert doc["culprits"][0]["evidence"][0]["text"] == "Fatal Python error: Segmentation fault"


def test_error_exit(tmp_path: Path) -> None:
    w0, w1 = writers(tmp_path)
    w1.log("train_shards: shard /d/a-000001.tar vanished", "ERROR")
    w1.exit(2, "DataError")
    w0.epoch(0, 1, 15)
    w0.flush()
    w1.flush()
    doc = run_diagnose(tmp_path)
    assert [(c["rank"], c["cause"]) for c in doc["culprits"]] == [(1, "error exit: DataError")]
    assert "vanished" in doc["culprits"][0]["evidence"][0]["text"]


def test_a_user_error_at_setup_is_in_setup_though_its_last_heartbeat_says_teardown(
    tmp_path: Path,
) -> None:
    """A damaged --perceptual_weights file stops rank 1 while it builds the model: its exit path
    writes a last heartbeat in phase `teardown`, and the verdict said `(phase teardown; exited
    with code 2)` for a rank that never trained."""
    w0, w1 = writers(tmp_path)
    w1.log("perceptual_weights: w/vgg.pth is not a readable torch weights file", "ERROR")
    w1.exit(2, "WeightsFileError")
    write_heartbeat(tmp_path, 1, 2, pid=dead_pid(), t=w1.t, phase="teardown", step=0,
                    state="exited")  # fmt: skip
    w0.epoch(0, 1, 15)
    w0.flush()
    w1.flush()
    doc = run_diagnose(tmp_path)
    assert culprits(doc) == [(1, "setup", "error exit: WeightsFileError")]
    assert doc["ranks"][1]["phase"] == "setup"


def test_error_exit_keeps_every_line_of_the_message(tmp_path: Path) -> None:
    """A user error's message can span lines (ConfigError): the evidence holds all of them."""
    w0, w1 = writers(tmp_path)
    w1.log("1 problem in the configuration:", "ERROR")
    w1.raw("  - precision: bf16-mixed needs a GPU with bfloat16")
    w1.exit(2, "ConfigError")
    w0.epoch(0, 1, 15)
    w0.flush()
    w1.flush()
    (culprit,) = run_diagnose(tmp_path)["culprits"]
    texts = [e["text"] for e in culprit["evidence"]]
    assert texts[0].endswith("1 problem in the configuration:")
    assert texts[1] == "  - precision: bf16-mixed needs a GPU with bfloat16"
    assert "Rank exiting with code 2: ConfigError" in texts[2]


def test_a_crash_before_the_first_marker_is_in_setup(tmp_path: Path) -> None:
    """The console verdict said `phase ?` for a rank that failed while it set up (a GPU node
    where the rank header could not read ae's version)."""
    (w0,) = writers(tmp_path, world=1)
    w0.fatal("PackageNotFoundError", "No package metadata was found for ae",
             [("/x/ae/rank/train.py", "main"), ("/usr/lib/python3.12/importlib/metadata.py",
               "version")])  # fmt: skip
    w0.flush()
    doc = run_diagnose(tmp_path)
    assert culprits(doc) == [(0, "setup", "exception: PackageNotFoundError")]


def test_every_failure_names_a_peer_then_the_first_is_blamed(tmp_path: Path) -> None:
    w0, w1 = writers(tmp_path)
    w1.fatal("DistBackendError", "NCCL error: remote process exited", BACKWARD_FRAMES)
    w0.t = w1.t + 1
    w0.fatal("DistBackendError", "NCCL error: remote process exited", BACKWARD_FRAMES)
    w0.flush()
    w1.flush()
    doc = run_diagnose(tmp_path)
    assert [c[0::2] for c in culprits(doc)] == [(1, "exception: DistBackendError")]
    assert "first rank to fail" in doc["culprits"][0]["rule"]


def test_a_chained_exception_that_started_with_a_peer_failure_is_a_victim(tmp_path: Path) -> None:
    w0, w1 = writers(tmp_path)
    w1.fatal("ValueError", "bad value", STEP_FRAMES)
    w0.t = w1.t + 0.2
    w0.fatal("KeyError", "'state'", BACKWARD_FRAMES)
    during = "During handling of the above exception, another exception occurred:"
    w0.lines[-1:-1] = ["", f"RuntimeError: {GLOO}", "", during]
    w0.flush()
    w1.flush()
    doc = run_diagnose(tmp_path)
    assert [c[0::2] for c in culprits(doc)] == [(1, "exception: ValueError")]
    assert [(v["rank"], v["cause"]) for v in doc["victims"]] == [(0, "peer failure: KeyError")]


def test_gloos_pair_timeout_through_a_comm_hook_is_a_peer_failure() -> None:
    """A link down, seen through DDP's comm hook (ae's non-finite hook wraps its all-reduce):
    gloo's timeout comes without its file path, and is still the network's, not the rank's."""
    from ae.diagnose.rank_status import is_peer_failure
    from ae.diagnose.tracebacks import Crash

    message = (
        "Got the following error when running the callback: RuntimeError: Application timeout "
        "caused pair closure"
    )
    assert is_peer_failure(Crash([], 0.0, "RuntimeError", "backward", message, "training step"))
    assert not is_peer_failure(Crash([], 0.0, "RuntimeError", "x", "shape mismatch", None))


def test_a_worker_killed_while_handing_over_a_batch_is_the_ranks_own_failure() -> None:
    """Seen in a fresh-clone run: the OOM killer took rank 1's dataloader worker while the rank
    fetched the batch's descriptor from it; the chain starts with that connection's reset, but
    the rank's failure is its worker's death, not a peer's."""
    from ae.diagnose.rank_status import is_peer_failure
    from ae.diagnose.tracebacks import Crash

    killed = "DataLoader worker (pid 10819) is killed by signal: Killed."
    chain = [
        "ConnectionResetError: [Errno 104] Connection reset by peer",
        f"RuntimeError: {killed}",
    ]
    assert not is_peer_failure(
        Crash([], 0.0, "RuntimeError", "x", killed, "data loading", chain=chain)
    )
    stopped = "DataLoader worker (pid 9) is killed by signal: Terminated."  # torchrun's SIGTERM
    chain = [chain[0], f"RuntimeError: {stopped}"]
    assert is_peer_failure(
        Crash([], 0.0, "RuntimeError", "x", stopped, "data loading", chain=chain)
    )
