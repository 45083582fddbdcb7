"""Checkpoint files: atomic writes, last/best/step layout, retention, and a SIGKILL mid-save."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from ae import atomic_files
from ae.config import CheckpointConfig
from ae.run_paths import RunDir
from ae.training.checkpoint_files import CheckpointStore
from ae.training.checkpointing import AtomicCheckpointIO, Checkpointing
from ae.training.position.resume_source import resolve_resume
from tests.support.crafted import crafted_checkpoint
from tests.support.runs import ROOT, run_launcher


def test_store_links_last_and_keeps_at_most_n(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path / "ckpt", keep=2)
    store.prepare()
    io = AtomicCheckpointIO()
    for step in (10, 20, 30):
        path = store.step_path(step)
        io.save_checkpoint({"global_step": step}, path)
        os.utime(path, (step, step))  # distinct write times, oldest first
        store.commit_step(path)
    names = sorted(p.name for p in store.dir.iterdir())
    assert names == ["last.ckpt", "step-00000020.ckpt", "step-00000030.ckpt"]
    assert torch.load(store.last, weights_only=False)["global_step"] == 30
    assert os.path.samefile(store.last, store.step_path(30))  # a link, not a second copy
    # pruning the file `last` points at leaves `last` intact (it is a link, not a name)
    CheckpointStore(store.dir, keep=1).commit_step(store.step_path(30))
    store.step_path(30).unlink()
    assert torch.load(store.last, weights_only=False)["global_step"] == 30


def test_step_files_before_a_step_leave_out_that_steps_own(tmp_path: Path) -> None:
    """A rollback at step 6 goes to the newest checkpoint of an earlier step on every rank, even
    when rank 0 has already written step 6's own (the guard's `newest_checkpoint(before=6)`)."""
    store = CheckpointStore(tmp_path, keep=3)
    for step in (2, 4, 6):
        store.step_path(step).write_bytes(b"")
        os.utime(store.step_path(step), (step, step))
    assert store.step_files()[-1] == store.step_path(6)
    assert store.step_files(before=6) == [store.step_path(2), store.step_path(4)]
    assert store.step_files(before=2) == []


def test_a_resume_from_an_older_checkpoint_of_the_folder_moves_last_to_it(tmp_path: Path) -> None:
    # Was: resumed from step 40 (before a divergence) while last.ckpt named step 60, a restart,
    # a requeue or a later `--resume_from_checkpoint=last` before this run's first save went
    # back to step 60, the steps it had gone back from (found by the overnight walkthrough)
    store = CheckpointStore(tmp_path / "ckpt", keep=3)
    store.prepare()
    for step in (40, 50, 60):
        store.step_path(step).write_bytes(str(step).encode())
        os.utime(store.step_path(step), (step, step))
        store.commit_step(store.step_path(step))
    said = store.resumed_from(store.step_path(40))
    assert os.path.samefile(store.last, store.step_path(40))
    assert said is not None and said.startswith(
        "last.ckpt now names step-00000040.ckpt, the checkpoint this run resumed (it named "
        "step-00000060.ckpt)"
    )
    # Nothing to do: resumed from last, from what last names, or from another folder's file
    assert store.resumed_from(store.last) is None
    assert store.resumed_from(store.step_path(40)) is None
    other = tmp_path / "other" / "step-00000070.ckpt"
    other.parent.mkdir()
    other.write_bytes(b"70")
    assert store.resumed_from(other) is None
    assert os.path.samefile(store.last, store.step_path(40))


def test_a_validation_loss_that_is_not_finite_is_said_once(
    tmp_path: Path, records: list[tuple[str, str]]
) -> None:
    # Was: a validation sample holding a NaN made val/loss nan at every epoch, and best.ckpt was
    # never saved, without a word (found by the overnight walkthrough)
    ckpt = Checkpointing(CheckpointConfig(), RunDir(tmp_path), {}, "")
    for step, value in ((31, float("nan")), (62, float("nan"))):
        trainer = SimpleNamespace(
            sanity_checking=False, is_global_zero=True, global_step=step,
            callback_metrics={"val/loss": torch.tensor(value)},
            strategy=SimpleNamespace(broadcast=lambda v, src: v),
        )  # fmt: skip
        ckpt.on_validation_end(trainer, None)  # type: ignore[arg-type]
    said = [m for _, m in records if m.startswith("Validation at step")]
    assert said == [
        "Validation at step 31: val/loss=nan is not finite; best.ckpt is not saved from it; a "
        "validation sample may hold NaN/Inf (`ae-shards inspect` on the validation shards names "
        "them), or the model's output is not finite"
    ]
    assert not (tmp_path / "checkpoints" / "best.ckpt").exists()


def test_a_validation_that_logs_no_val_loss_is_said_once(
    tmp_path: Path, records: list[tuple[str, str]]
) -> None:
    # Was: a LightningModule of the user's logging `val_loss` (Lightning's habit) never had a
    # best.ckpt, without a word (found by the own-model walkthrough)
    ckpt = Checkpointing(CheckpointConfig(), RunDir(tmp_path), {}, "")
    for step in (23, 46):
        trainer = SimpleNamespace(
            sanity_checking=False, is_global_zero=True, global_step=step,
            callback_metrics={"val_loss": torch.tensor(0.5), "train_loss": torch.tensor(0.4)},
            strategy=SimpleNamespace(broadcast=lambda v, src: v),
        )  # fmt: skip
        ckpt.on_validation_end(trainer, None)  # type: ignore[arg-type]
    said = [m for _, m in records if m.startswith("No best.ckpt")]
    assert said == [
        "No best.ckpt: the model logged no val/loss in validation (it logged train_loss, "
        'val_loss); a LightningModule of your own logs it with self.log("val/loss", loss, '
        "sync_dist=True) in validation_step, or pass --save_best=false"
    ]
    records.clear()
    quiet = Checkpointing(CheckpointConfig(save_best=False), RunDir(tmp_path), {}, "")
    quiet.on_validation_end(trainer, None)  # type: ignore[arg-type]
    assert not [m for _, m in records if m.startswith("No best.ckpt")]


def test_prepare_removes_leftovers_of_a_killed_save(tmp_path: Path) -> None:
    (tmp_path / ".step-00000004.ckpt.4242-0a1b2c3d.tmp").write_bytes(b"partial")
    (tmp_path / "step-00000002.ckpt").write_bytes(b"whole")
    CheckpointStore(tmp_path, keep=3).prepare()
    assert [p.name for p in tmp_path.iterdir()] == ["step-00000002.ckpt"]


def test_resolve_resume(tmp_path: Path, records: list[tuple[str, str]]) -> None:
    assert resolve_resume(None, tmp_path) is None
    assert resolve_resume("last", tmp_path) is None  # nothing yet: a fresh start
    assert records[-1][1].endswith("last.ckpt yet; starting from scratch")
    # Was: the same "no last.ckpt yet" after a RESTART line that promised a checkpoint, when
    # the folder had been deleted in between: the steps lost without a word of why.
    promised = str(tmp_path / "step-00000004.ckpt")
    assert resolve_resume("last", tmp_path, expected=promised) is None
    assert f"the checkpoint this restart was to resume from ({promised}) is gone" in records[-1][1]
    (tmp_path / "last.ckpt").write_bytes(b"x")
    assert resolve_resume("last", tmp_path) == tmp_path / "last.ckpt"
    assert resolve_resume("/x/step-1.ckpt", tmp_path) == Path("/x/step-1.ckpt")


def _train(
    args: list[str], out: Path, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    """One training process without torchrun (world size 1): train_ae.py itself."""
    return subprocess.run(
        [sys.executable, str(ROOT / "train_ae.py"), f"--output_dir={out}", *args],
        cwd=ROOT, env={**os.environ, **(env or {})}, capture_output=True, text=True, timeout=240,
    )  # fmt: skip


@pytest.mark.slow
def test_sigkill_during_checkpoint_save_leaves_last_loadable(tmp_path: Path, make_shards) -> None:
    train = make_shards([32, 32], name="train")
    val = make_shards([16], name="val")
    out = tmp_path / "run"
    args = [f"--train_shards={train}", f"--val_shards={val}", "--batch_size=8", "--num_workers=0",
            "--max_steps=6", "--checkpointing_period=2", "--save_best=false"]  # fmt: skip
    # The 2nd checkpoint write (step 4) is killed after its bytes are written, before the rename.
    killed = _train(args, out, {"AE_FAULT": "kill@checkpoint:step=4"})
    assert killed.returncode == -9, killed.stderr[-3000:]
    ckpt = out / "checkpoints"
    (partial,) = atomic_files.leftovers(ckpt)  # the save really was cut off
    assert partial.name.startswith(".step-00000004.ckpt.")
    assert not (ckpt / "step-00000004.ckpt").exists()
    state = torch.load(ckpt / "last.ckpt", weights_only=False)
    assert state["global_step"] == 2 and state["ae_config"]["checkpointing_period"] == 2
    # ... and a run resumed from it continues from step 2, cleaning up the leftover.
    resumed = _train([*args, "--resume_from_checkpoint=last"], out)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    (log,) = [p for p in (out / "logs").glob("train_*.log") if "Resumed" in p.read_text()]
    text = log.read_text()
    assert re.search(rf"Removing \S*/{re.escape(partial.name)}: left by a checkpoint save", text)
    assert re.search(r"Resumed from .*last\.ckpt at step 2 ", text)
    assert torch.load(ckpt / "last.ckpt", weights_only=False)["global_step"] == 6
    assert atomic_files.leftovers(ckpt) == []


# Both made by the code that wrote them (tests/fixtures/README.md): demo data, 1 process,
# hidden_dim=8, latent_dim=4, max_steps=6, checkpointing_period=3; their step-3 checkpoints.
# pre_layout_step3: before `ae/` moved into sub-packages (it pickles `ae.decode.InputSpec`);
# spec_object_ema_step3: before the safe loader, with --ema_decay=0.9 (`ae.data.decode.InputSpec`).
OLD_CHECKPOINTS = {"pre_layout_step3": [], "spec_object_ema_step3": ["--ema_decay=0.9"]}
FIXTURE_ARGS = ["--devices=1", "--num_workers=0", "--hidden_dim=8", "--latent_dim=4",
                "--max_steps=6", "--max_epochs=1", "--checkpointing_period=3"]  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("name", list(OLD_CHECKPOINTS))
def test_checkpoints_of_older_code_resume_under_the_safe_loader(name: str, tmp_path: Path) -> None:
    fixture = ROOT / "tests" / "fixtures" / f"{name}.ckpt"
    args = [*FIXTURE_ARGS, *OLD_CHECKPOINTS[name], f"--resume_from_checkpoint={fixture}"]
    out = tmp_path / "run"
    res = _train(args, out, {"AE_CACHE_DIR": str(tmp_path / "cache")})
    assert res.returncode == 0, res.stderr[-3000:]
    (log,) = (out / "logs").glob("train_*.log")
    text = log.read_text()
    assert re.search(rf"Resumed from .*{name}\.ckpt at step 3 ", text)
    # its data position, where Lightning kept it then, is resumed too
    (debug,) = (out / "logs").glob("debug_rank0_*.log")
    assert "Resuming the train data at epoch 0, batch 3 of" in debug.read_text()
    assert "Training finished at step 6" in text
    assert "not created with WeightAveraging" not in text  # the EMA state came back too
    # what this code writes needs no allow-list: torch's own safe loader reads it
    last = out / "checkpoints" / "last.ckpt"
    assert torch.serialization.get_unsafe_globals_in_checkpoint(last) == []
    assert torch.load(last, weights_only=True)["global_step"] == 6


@pytest.mark.slow
def test_a_checkpoint_that_runs_code_is_refused_by_resume_and_ae_encode(
    tmp_path: Path, make_shards
) -> None:
    """A real checkpoint plus an object whose unpickling creates a file: resume and ae-encode
    refuse it (exit 2, one message naming the global and the file), the file never appears;
    --trust_checkpoint resumes from it, and then the file's code has run."""
    marker = tmp_path / "created_by_unpickling"
    fixture = ROOT / "tests" / "fixtures" / "spec_object_ema_step3.ckpt"
    evil = crafted_checkpoint(fixture, tmp_path / "evil.ckpt", marker)
    refusal = f"{evil}: refused: loading this checkpoint would run code named in it (io.open)"
    args = [*FIXTURE_ARGS, "--ema_decay=0.9", f"--resume_from_checkpoint={evil}"]
    # through the launcher and torchrun, one rank: every rank reads the file before training
    # (ae.rank.train's open_resume) and refuses it alone; a second would say the same (~4.5 s CPU)
    res = run_launcher(args, tmp_path / "run")
    assert res.returncode == 2 and refusal in res.output, res.output
    assert "--trust_checkpoint loads it anyway" in res.output and "Traceback" not in res.output
    assert "TRAINING START" not in res.text("debug_rank*.log") and not marker.exists()

    shards = make_shards([8], kind="png")  # 8x8 gray, as the demo digits
    enc = subprocess.run(
        [sys.executable, "-m", "ae.cli.encode", str(evil), shards, str(tmp_path / "latents")],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert enc.returncode == 2 and refusal in enc.stdout + enc.stderr, enc.stdout + enc.stderr
    assert not (tmp_path / "latents").exists()  # refused in the launcher: no rank started
    assert not marker.exists()

    trusted = _train([*FIXTURE_ARGS, "--ema_decay=0.9", f"--resume_from_checkpoint={evil}",
                      "--trust_checkpoint"], tmp_path / "trusted",
                     {"AE_CACHE_DIR": str(tmp_path / "cache")})  # fmt: skip
    assert trusted.returncode == 0, trusted.stderr[-3000:]
    assert marker.exists()
    text = "".join(p.read_text() for p in (tmp_path / "trusted" / "logs").glob("train_*.log"))
    assert re.search(r"Resumed from .*evil\.ckpt at step 3 ", text)
