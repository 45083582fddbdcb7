"""Settings that cannot carry over from a checkpoint: compared, key by key, before training."""

from __future__ import annotations

import zipfile
from pathlib import Path

import pytest
import torch
from torch import nn

from ae.training.position.checkpoint_read import NotAnAeCheckpoint
from ae.training.position.model_fit import ResumeRefused, incompatible
from ae.training.position.resume_source import nothing_left, open_resume


def test_changed_shape_flags_are_listed_checkpoint_to_flag() -> None:
    saved = {"latent_dim": 2, "learning_rate": 1e-3, "image_size": 0}
    now = {"latent_dim": 3, "learning_rate": 5e-4, "image_size": 0}
    weights = nn.Linear(4, 2).state_dict()
    assert incompatible(saved, now, weights, nn.Linear(4, 3)) == ["latent_dim: 2 -> 3"]
    # the same weights fit: nothing to refuse, whatever else changed
    assert incompatible(saved, now, weights, nn.Linear(4, 2)) == []


def test_flags_alike_but_data_of_another_shape_names_the_weights() -> None:
    # e.g. the same --image_size=0 on images of another native size
    problems = incompatible({}, {}, nn.Linear(4, 2).state_dict(), nn.Linear(6, 2))
    assert problems == ["weight: 2x4 -> 2x6"]


def test_a_vae_toggle_is_named() -> None:
    saved, now = {"kl_weight": 0.0}, {"kl_weight": 1e-4}
    problems = incompatible(saved, now, nn.Linear(4, 2).state_dict(), nn.Linear(4, 4))
    assert problems == ["kl_weight: 0.0 -> 0.0001"]


def test_open_resume_refuses_another_model_with_one_message(tmp_path: Path) -> None:
    path = tmp_path / "a.ckpt"
    torch.save({"ae_config": {"model": "conv"}, "state_dict": nn.Linear(4, 2).state_dict()}, path)
    with pytest.raises(ResumeRefused) as e:
        open_resume(str(path), tmp_path, {"model": "mlp"}, nn.Linear(4, 3))
    assert e.value.exit_code == 2
    assert "(checkpoint -> flags):\n  model: 'conv' -> 'mlp'\n" in e.value.render()
    source = open_resume(str(path), tmp_path, {"model": "conv"}, nn.Linear(4, 2))  # fits
    assert source is not None and source.path == path


def test_open_resume_names_a_file_no_ae_run_saved(tmp_path: Path) -> None:
    """Was: a zip of other files failed in torch's reader (`RuntimeError: [enforce fail at
    inline_container.cc:180] . file in archive is not in a subdirectory`), a torch file without
    ae's keys in Lightning's load: a FATAL traceback of every rank, `Training failed`."""
    other = tmp_path / "other.ckpt"
    with zipfile.ZipFile(other, "w") as z:
        z.writestr("a.txt", "hi")
    weights = tmp_path / "weights.ckpt"
    torch.save(nn.Linear(4, 2).state_dict(), weights)  # a model's weights alone
    for path, why in ((other, "not a readable checkpoint: RuntimeError"),
                      (weights, "not a checkpoint written by ae")):  # fmt: skip
        with pytest.raises(NotAnAeCheckpoint) as e:
            open_resume(str(path), tmp_path, {}, nn.Linear(4, 2))
        said = e.value.render()
        assert said.startswith(f"resume_from_checkpoint: {path}: {why}"), said
        assert said.endswith("; it takes a checkpoint an ae run saved "
                             "(<output_dir>/checkpoints/*.ckpt), or last")  # fmt: skip


def test_a_model_left_at_auto_is_named_with_the_model_it_built() -> None:
    """Was `model: 'auto' -> 'resnet'`: which model the checkpoint holds went unsaid."""
    built = ({"model": "conv"}, {"model": "resnet"})
    problems = incompatible(
        {"model": "auto"}, {"model": "resnet"}, nn.Linear(4, 2).state_dict(), nn.Linear(4, 3),
        built,
    )  # fmt: skip
    assert problems == ["model: 'auto' (conv) -> 'resnet'"]


def test_another_input_is_refused_even_where_the_weights_fit() -> None:
    weights = nn.Conv2d(3, 4, 3).state_dict()  # fully convolutional: any image size fits
    saved, now = {"image_size": 64, "input_key": "jpg"}, {"image_size": 128, "input_key": "jpg"}
    assert incompatible(saved, now, weights, nn.Conv2d(3, 4, 3)) == ["image_size: 64 -> 128"]
    # unset in the checkpoint's run: ae chose from the data; nothing to compare
    assert incompatible({"image_size": 0}, now, weights, nn.Conv2d(3, 4, 3)) == []


def test_another_input_is_named_as_the_data_not_as_the_model_flag(tmp_path: Path) -> None:
    """A run of `--model=mlp` on vectors of 16, resumed with `--model` left at `auto` on vectors
    of 8: `auto` is the same mlp, so the message names the input, not `model: 'mlp' -> 'auto'`."""
    path = tmp_path / "a.ckpt"
    saved_hp = {"spec": {"kind": "vector", "shape": (16,)}, "model": "mlp"}
    torch.save(
        {
            "ae_config": {"model": "mlp"},
            "hyper_parameters": saved_hp,
            "state_dict": nn.Linear(16, 2).state_dict(),
        },
        path,
    )
    now = nn.Linear(8, 2)
    now.hparams = {"spec": {"kind": "vector", "shape": (8,)}, "model": "mlp"}  # as AutoEncoder's
    with pytest.raises(ResumeRefused) as e:
        open_resume(str(path), tmp_path, {"model": "auto"}, now)
    listed = e.value.render().split("(checkpoint -> flags):\n")[1].split("\nResume")[0]
    assert listed == "  input: vectors of 16 -> vectors of 8 (the samples these flags read)"
    # `auto` resolved to what the checkpoint's flag named, on the same data: resumed
    same = nn.Linear(16, 2)
    same.hparams = saved_hp
    assert open_resume(str(path), tmp_path, {"model": "auto"}, same) is not None


def test_a_resume_that_trains_nothing_names_the_limit_it_is_at(tmp_path: Path) -> None:
    """`--resume_from_checkpoint=last` with the limit the run had reached: the console said only
    `Training finished at step 10` (tests/e2e/test_position.py: the --max_epochs case, live)."""
    path = tmp_path / "last.ckpt"
    said = "Nothing left to train: {p} is at step 10, where {limit} ends the run; raise it"
    assert nothing_left(path, 10, 10, -1) == said.format(p=path, limit="--max_steps=10")
    assert nothing_left(path, 10, -1, 2) == said.format(p=path, limit="--max_epochs=2")
    assert nothing_left(path, 10, 20, 2) == said.format(p=path, limit="--max_epochs=2")
