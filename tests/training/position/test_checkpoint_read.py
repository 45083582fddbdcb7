"""The safe checkpoint loader: older ae checkpoints load and encode, a checkpoint that would run
code is refused naming the global and the file (nothing of it runs), and runs only when trusted.
The slow end-to-end side (resume and ae-encode refusing it) is in test_checkpointing.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ae.config import Config, OptimConfig
from ae.data.decoding.decode import InputSpec
from ae.training.encoding import load_checkpoint, model_from_checkpoint
from ae.training.model import AutoEncoder
from ae.training.position import checkpoint_read
from ae.training.position.checkpoint_read import UntrustedCheckpoint, spec_from_record
from tests.support.crafted import crafted_checkpoint
from tests.support.runs import ROOT

FIXTURES = ROOT / "tests" / "fixtures"
# Made by the code that wrote them (tests/fixtures/README.md): each pickles the input spec.
OLD_CHECKPOINTS = {
    "pre_layout_step3.ckpt": "ae.decode.InputSpec",
    "spec_object_ema_step3.ckpt": "ae.data.decode.InputSpec",
}
DIGITS = InputSpec("image", (1, 8, 8))  # what both were trained on: the demo digits


@pytest.mark.parametrize("name", list(OLD_CHECKPOINTS))
def test_older_checkpoints_load_and_encode_under_the_safe_loader(name: str) -> None:
    path = FIXTURES / name
    # torch alone refuses the pickled spec; the loader rebuilds it by name, nothing else
    assert torch.serialization.get_unsafe_globals_in_checkpoint(path) == [OLD_CHECKPOINTS[name]]
    assert checkpoint_read.unsafe_globals(path) == []
    ckpt = load_checkpoint(path)
    assert spec_from_record(ckpt["hyper_parameters"]["spec"]) == DIGITS
    model, latent = model_from_checkpoint(ckpt, DIGITS, name)
    assert latent == (4,)
    assert model.encode(torch.rand(3, *DIGITS.shape)).shape == (3, 4)


def test_new_checkpoints_hold_only_plain_data(tmp_path: Path) -> None:
    """The spec is a plain dict now: plain torch.load(weights_only=True) reads the hparams."""
    model = AutoEncoder(DIGITS, Config.from_flat({"hidden_dim": 8}).model, OptimConfig())
    path = tmp_path / "h.ckpt"
    torch.save({"hyper_parameters": dict(model.hparams)}, path)
    assert torch.serialization.get_unsafe_globals_in_checkpoint(path) == []
    record = torch.load(path, weights_only=True)["hyper_parameters"]["spec"]
    assert spec_from_record(record) == DIGITS


def test_a_checkpoint_that_runs_code_is_refused_and_runs_only_when_trusted(tmp_path: Path) -> None:
    marker = tmp_path / "created_by_unpickling"
    evil = crafted_checkpoint(
        FIXTURES / "spec_object_ema_step3.ckpt", tmp_path / "evil.ckpt", marker
    )
    refusal = rf"{evil}: refused: loading this checkpoint would run code named in it \(io\.open\)"
    with pytest.raises(UntrustedCheckpoint, match=refusal) as err:
        checkpoint_read.load(evil)
    assert err.value.exit_code == 2 and "--trust_checkpoint" in err.value.render()
    with pytest.raises(UntrustedCheckpoint, match=refusal):
        load_checkpoint(evil)  # ae-encode's loader
    assert not marker.exists()
    ckpt = load_checkpoint(evil, trust=True)  # the old way: the file's code runs
    assert marker.exists() and ckpt["global_step"] == 3


def test_a_file_that_is_no_pickle_is_no_refusal(tmp_path: Path) -> None:
    junk = tmp_path / "junk.ckpt"
    junk.write_bytes(b"not a checkpoint")
    assert checkpoint_read.unsafe_globals(junk) == []
    with pytest.raises(Exception) as err:
        checkpoint_read.load(junk)
    assert not isinstance(err.value, UntrustedCheckpoint)


def test_a_truncated_checkpoint_is_named_damaged_with_the_newest_complete_one(
    tmp_path: Path,
) -> None:
    for step in (10, 20):
        torch.save(
            {"global_step": step, "state_dict": {"w": torch.ones(64)}},
            tmp_path / f"step-{step:08d}.ckpt",
        )
    whole = tmp_path / "step-00000030.ckpt"
    torch.save({"global_step": 30, "state_dict": {"w": torch.ones(4096)}}, whole)
    (tmp_path / "step-00000040.ckpt").write_bytes(whole.read_bytes()[:3000])  # a cut copy
    whole.write_bytes(whole.read_bytes()[:-100])  # truncated: the newest complete one is step 20
    damaged = tmp_path / "step-00000040.ckpt"
    with pytest.raises(checkpoint_read.DamagedCheckpoint) as e:
        checkpoint_read.read(damaged)
    assert e.value.exit_code == 2
    assert f"{damaged}: the checkpoint file is damaged (truncated" in e.value.render()
    assert e.value.instead == tmp_path / "step-00000020.ckpt"
    assert checkpoint_read.read(e.value.instead)["global_step"] == 20
