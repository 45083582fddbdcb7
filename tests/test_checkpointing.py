"""Checkpoint files: atomic writes, last/best/step layout, retention, and a SIGKILL mid-save."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from ae.checkpoint_files import CheckpointStore, atomic_write, human_size, resolve_resume
from ae.checkpointing import AtomicCheckpointIO


def test_atomic_write_failure_leaves_the_previous_file(tmp_path: Path) -> None:
    target = tmp_path / "a.ckpt"
    atomic_write(target, lambda f: f.write(b"old"))

    def broken(f) -> None:
        f.write(b"half of the new")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        atomic_write(target, broken)
    assert target.read_bytes() == b"old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.ckpt"]


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


def test_prepare_removes_leftovers_of_a_killed_save(tmp_path: Path) -> None:
    (tmp_path / "step-00000004.ckpt.tmp").write_bytes(b"partial")
    CheckpointStore(tmp_path, keep=3).prepare()
    assert list(tmp_path.iterdir()) == []


def test_resolve_resume(tmp_path: Path) -> None:
    assert resolve_resume(None, tmp_path) is None
    assert resolve_resume("last", tmp_path) is None  # nothing yet: a fresh start
    (tmp_path / "last.ckpt").write_bytes(b"x")
    assert resolve_resume("last", tmp_path) == tmp_path / "last.ckpt"
    assert resolve_resume("/x/step-1.ckpt", tmp_path) == Path("/x/step-1.ckpt")


def test_human_size() -> None:
    assert [human_size(n) for n in (12, 2048, 3 * 2**20, 5 * 2**30)] == [
        "12 B", "2.0 KB", "3.0 MB", "5.00 GB"]  # fmt: skip
