"""`ae` as users install it: a regular (non-editable) `pip install`, run from another folder."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.runs import ROOT


@pytest.mark.slow
def test_ae_train_from_a_regular_install(tmp_path: Path) -> None:
    """The console script trains with nothing from the checkout: the rank module, the demo data
    file and the launcher all come from the installed package."""
    site = tmp_path / "site"
    build = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation",
         "--target", str(site), str(ROOT)],
        capture_output=True, text=True, timeout=300, cwd=tmp_path,
    )  # fmt: skip
    assert build.returncode == 0, build.stderr[-3000:]
    assert not (site / "ae" / "__editable__").exists()
    assert (site / "ae" / "rank" / "train.py").is_file()
    out = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": str(site), "AE_CACHE_DIR": str(tmp_path / "cache")}
    env.pop("AE_RUN_TS", None)
    res = subprocess.run(
        [str(site / "bin" / "ae-train"), f"--output_dir={out}", "--max_steps=2", "--devices=2",
         "--num_workers=0", "--max_epochs=1"],
        capture_output=True, text=True, timeout=240, cwd=tmp_path, env=env,
    )  # fmt: skip
    assert res.returncode == 0, (res.stdout + res.stderr)[-3000:]
    for rank in (0, 1):
        (log,) = (out / "logs").glob(f"debug_rank{rank}_*.log")
        where = re.search(r"ae=\S+ \((.+)\)", log.read_text())
        assert where and Path(where[1]) == site / "ae", where
