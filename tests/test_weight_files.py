"""Where the LPIPS and FID Inception files are looked for, and the launcher's message when they
are not there."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import pytest

from ae.config.weight_files import (
    FID_FILE,
    FID_URL,
    HEADS_FILE,
    VGG16_FILE,
    VGG16_URL,
    fid_file,
    fid_missing_problem,
    missing_problem,
    resolve,
    torch_hub_checkpoints,
)


def test_torch_hub_rule(tmp_path: Path) -> None:
    home = Path.home()
    assert torch_hub_checkpoints({}) == home / ".cache/torch/hub/checkpoints"
    assert torch_hub_checkpoints({"XDG_CACHE_HOME": "/c"}) == Path("/c/torch/hub/checkpoints")
    both = {"XDG_CACHE_HOME": "/c", "TORCH_HOME": str(tmp_path)}
    assert torch_hub_checkpoints(both) == tmp_path / "hub/checkpoints"


def test_torch_hub_rule_is_torchs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    torch_hub = pytest.importorskip("torch.hub")
    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "th"))
    assert torch_hub_checkpoints() == Path(torch_hub.get_dir()) / "checkpoints"
    monkeypatch.delenv("TORCH_HOME")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert torch_hub_checkpoints() == Path(torch_hub.get_dir()) / "checkpoints"


def test_auto_missing_names_both_files_where_and_how(tmp_path: Path) -> None:
    env = {"TORCH_HOME": str(tmp_path)}
    folder = tmp_path / "hub/checkpoints"
    problem = missing_problem("auto", env)
    assert problem is not None
    assert f"missing from {folder}" in problem
    assert f"curl -L --create-dirs -o {folder / VGG16_FILE} {VGG16_URL}" in problem
    assert f"lpips/weights/v0.1/vgg.pth -d {folder}" in problem
    folder.mkdir(parents=True)
    (folder / VGG16_FILE).write_bytes(b"x")
    problem = missing_problem("auto", env)
    assert problem is not None and VGG16_FILE not in problem and HEADS_FILE in problem
    (folder / HEADS_FILE).write_bytes(b"x")
    assert missing_problem("auto", env) is None


def test_a_folder_of_ones_own(tmp_path: Path) -> None:
    assert "no such folder" in str(missing_problem(str(tmp_path / "nope")))
    # the file itself given (as --fid_weights takes it): was 'no such folder: .../vgg.pth'
    (tmp_path / HEADS_FILE).write_bytes(b"")
    assert missing_problem(str(tmp_path / HEADS_FILE)) == (
        f"{tmp_path / HEADS_FILE} is a file; give the folder holding {VGG16_FILE} and "
        f"{HEADS_FILE} (--perceptual_weights={tmp_path})"
    )
    (tmp_path / HEADS_FILE).unlink()
    problem = missing_problem(str(tmp_path))
    assert problem is not None and f"missing from {tmp_path}" in problem
    assert "--perceptual_weights=FOLDER" not in problem  # said only for auto
    files = resolve(str(tmp_path))
    assert (files.vgg16, files.heads) == (tmp_path / VGG16_FILE, tmp_path / HEADS_FILE)


def test_heads_of_an_installed_lpips_are_found_without_importing_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pkg = tmp_path / "site" / "lpips"
    (pkg / "weights/v0.1").mkdir(parents=True)
    (pkg / "__init__.py").write_text("raise RuntimeError('imported')\n")
    (pkg / "weights/v0.1/vgg.pth").write_bytes(b"heads")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    importlib.invalidate_caches()
    env = {"TORCH_HOME": str(tmp_path / "th")}
    assert resolve("auto", env).heads == pkg / "weights/v0.1/vgg.pth"
    assert "lpips" not in sys.modules
    # a folder of one's own is that folder only
    assert resolve(str(tmp_path), env).heads == tmp_path / HEADS_FILE


def test_the_names_are_the_loaders() -> None:
    """The launcher's copy of the file names (it cannot import torch) is the loader's."""
    from ae.config import weight_files
    from ae.training import perceptual

    assert (weight_files.VGG16_FILE, weight_files.HEADS_FILE, weight_files.VGG16_URL) == (
        perceptual.VGG16_FILE,
        perceptual.HEADS_FILE,
        perceptual.VGG16_URL,
    )
    from ae.training import inception

    assert (weight_files.FID_FILE, weight_files.FID_URL) == (inception.FID_FILE, inception.FID_URL)


def test_fid_weights_a_file_or_its_folder(tmp_path: Path) -> None:
    file = tmp_path / FID_FILE
    assert fid_file(str(file)) == file
    assert fid_file(str(tmp_path)) == file  # a folder holding it
    problem = fid_missing_problem(str(tmp_path))
    assert problem is not None
    assert problem.startswith(f"no such file: {file}: rFID needs the FID Inception v3 weights")
    assert f"curl -L --create-dirs -o {file} {FID_URL}" in problem
    file.write_bytes(b"x")
    assert fid_missing_problem(str(tmp_path)) is None
    assert fid_missing_problem(str(file)) is None
    own = tmp_path / "elsewhere" / "inception.pth"  # a name of one's own is kept
    assert f"-o {own} {FID_URL}" in str(fid_missing_problem(str(own)))
