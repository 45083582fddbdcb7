"""Which phase a crash's frames point at: derived from where ae's modules really are."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from ae.diagnose.phases import MODULE_PHASES, module_path, phase_of_frames


@pytest.mark.parametrize(("module", "phase"), MODULE_PHASES)
def test_each_named_module_exists_and_its_frames_get_its_phase(module: str, phase: str) -> None:
    spec = importlib.util.find_spec(module)
    assert spec is not None and spec.origin is not None, f"{module} moved: update MODULE_PHASES"
    source = Path(spec.origin)  # a real file of the module (or package) as installed
    frames = [(str(source), "some_function"), ("/x/train_ae.py", "main")]
    assert phase_of_frames(frames) == phase


def test_paths_are_suffixes_of_the_real_files() -> None:
    assert module_path("ae.data") == "ae/data/"
    assert module_path("ae.training.sampling") == "ae/training/sampling.py"
    with pytest.raises(ModuleNotFoundError, match=r"ae\.training\.nowhere"):
        module_path("ae.training.nowhere")


def test_a_frame_deep_in_the_data_package_is_data_loading() -> None:
    frames = [("/venv/site-packages/ae/data/shards/tar_samples.py", "read"),
              ("/venv/site-packages/torch/utils/data/dataloader.py", "__next__")]  # fmt: skip
    assert phase_of_frames(frames) == "data loading"
    assert phase_of_frames([("/venv/site-packages/ae/training/model.py", "training_step")]) == (
        "training step"
    )
