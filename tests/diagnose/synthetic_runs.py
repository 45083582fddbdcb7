"""Made-up runs for the ae-diagnose verdict tests: each rank's logs written with the real line
formats (bench/synthetic_logs.py), a pid that is gone, the diagnosis of a log folder, its
culprits as (rank, phase, cause), and the stack frames of the usual failures."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

from ae.diagnose.log_files import find_run
from ae.diagnose.report import diagnose
from bench.synthetic_logs import RankWriter, write_train_log

GLOO = (
    "[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer "
    "[127.0.0.1]:54927. This is typically caused by a remote worker crashing."
)
STEP_FRAMES = [("/x/train_ae.py", "main"), ("/x/ae/training/model.py", "training_step"),
               ("/x/ae/forensics/faults.py", "_injected_raise")]  # fmt: skip
BACKWARD_FRAMES = [("/x/train_ae.py", "main"),
                   ("/x/torch/autograd/graph.py", "_engine_run_backward")]  # fmt: skip
SEGV_FRAMES = [("/x/ae/forensics/faults.py", "_injected_segv"),
               ("/x/ae/training/model.py", "training_step")]  # fmt: skip


def dead_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def run_diagnose(logs: Path) -> dict[str, Any]:
    return diagnose(find_run(logs))


def culprits(doc: dict[str, Any]) -> list[tuple[int, str | None, str]]:
    return [(c["rank"], c["phase"], c["cause"]) for c in doc["culprits"]]


def writers(logs: Path, world: int = 2, t: float | None = None) -> list[RankWriter]:
    write_train_log(logs, world)
    out = []
    for rank in range(world):
        w = RankWriter(logs, rank, world) if t is None else RankWriter(logs, rank, world, t=t)
        w.start()
        out.append(w)
    return out
