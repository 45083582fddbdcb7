"""`./train_ae.sh` run from another folder: the paths the user gives are relative to where the
command ran, not to the checkout the script lives in (it changes into the checkout only to
install)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from tests.support.runs import ROOT


def test_output_dir_model_and_shards_resolve_against_the_callers_folder(tmp_path: Path) -> None:
    """`--output_dir=runs/x` lands in the caller's folder and `--model=mymod:Cls` is found there
    (the launcher's model check passes); the relative shard spec is looked up there too (none
    exists: the one message, exit 2, names it). Nothing is created in the checkout."""
    (tmp_path / "mymod.py").write_text("class Cls:\n    pass\n")
    out = f"runs/x-{os.getpid()}"  # a name the checkout cannot hold already
    env = {k: v for k, v in os.environ.items() if k != "AE_RUN_TS"}
    done = subprocess.run(
        [str(ROOT / "train_ae.sh"), f"--output_dir={out}", "--model=mymod:Cls",
         "--train_shards=data/missing-{000..001}.tar", "--max_epochs=1"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    said = done.stdout + done.stderr
    assert done.returncode == 2, said
    assert "no module" not in said and "mymod" not in said, said
    assert "data/missing-" in said and "Traceback" not in said, said
    assert (tmp_path / out).is_dir(), said
    assert not (ROOT / out).exists()
