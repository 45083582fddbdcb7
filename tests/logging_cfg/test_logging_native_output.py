"""Native output (C/C++ writes to fd 1 and 2) in real processes: into each rank's native file
from the first line, Python-level output too except on the console rank, whose dataloader
workers write theirs to the file."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.logging_cfg.rank_processes import run_rank
from tests.support.runs import ROOT


def test_native_output_goes_to_the_rank_file(tmp_path: Path) -> None:
    body = """
    print("python-level print")
    os.write(1, b"native stdout\\n")
    os.write(2, b"native stderr\\n")
    """
    rank1 = run_rank(tmp_path, body, rank=1, native_output=True)
    rank0 = run_rank(tmp_path, body, rank=0, native_output=True)
    assert rank1.returncode == rank0.returncode == 0
    # Rank 1: everything, Python-level output included, is in its native file.
    assert rank1.stdout == rank1.stderr == ""
    native1 = (tmp_path / "native_rank1_TS.log").read_text()
    assert native1 == "python-level print\nnative stdout\nnative stderr\n"
    # Rank 0: Python-level output keeps the console; native writes go to the file.
    assert rank0.stdout == "python-level print\n"
    assert (tmp_path / "native_rank0_TS.log").read_text() == "native stdout\nnative stderr\n"


def test_a_console_ranks_dataloader_worker_writes_python_output_to_the_native_file(
    tmp_path: Path,
) -> None:
    """Rank 0 keeps the console for Python-level output; its dataloader workers (forked, through
    the loader's worker_init_fn) do not: a traceback that multiprocessing's queue thread prints
    in a worker (shared memory full) belongs in the native log."""
    body = """
    import torch
    from ae.data.stream.loader import PreemptibleLoader

    class Talks(torch.utils.data.IterableDataset):
        def __iter__(self):
            print("printed in a worker", file=sys.stderr)
            yield torch.zeros(1)

    print("printed in the rank")
    assert len(list(PreemptibleLoader(Talks(), num_workers=1, batch_size=None))) == 1
    """
    rank0 = run_rank(tmp_path, body, rank=0, native_output=True)
    assert rank0.returncode == 0, rank0.stderr
    assert rank0.stdout == "printed in the rank\n"
    assert "printed in a worker" not in rank0.stderr
    assert "printed in a worker\n" in (tmp_path / "native_rank0_TS.log").read_text()


EARLY = """
import os, sys
from pathlib import Path
import logging_cfg
ctx = logging_cfg.RankContext(rank={rank}, world_size=2)
logging_cfg.start_native_capture(Path({logs!r}), ctx, {ts!r})
os.write(2, b"[I1123 09:47:17.6 debug.cpp:48] [c10d] before the run TS is known\\n")
print("python-level before", flush=True)
logging_cfg.configure(Path({logs!r}), "TS", ctx, native_output=True)
os.write(2, b"native after configure\\n")
print("python-level after")
"""


def test_native_output_is_captured_from_the_first_line(tmp_path: Path) -> None:
    """A rank captures before anything else; without the run's TS yet into a pending file, which
    `configure` renames (or appends to the run's file when that exists)."""
    for rank, ts in ((1, None), (0, "TS")):
        code = EARLY.format(rank=rank, logs=str(tmp_path), ts=ts)
        proc = subprocess.run(
            [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60
        )
        assert proc.returncode == 0, proc.stderr
        assert "[I1123" not in proc.stderr + proc.stdout
    native1 = (tmp_path / "native_rank1_TS.log").read_text()
    assert native1.startswith("[I1123 09:47:17.6 debug.cpp:48] [c10d] before the run TS")
    assert "python-level before\nnative after configure\npython-level after\n" in native1
    native0 = (tmp_path / "native_rank0_TS.log").read_text()  # rank 0 keeps its console
    assert native0.endswith("is known\nnative after configure\n")
    assert not list(tmp_path.glob(".native*"))  # the pending file became the rank's file
    # a second process of rank 1 in the same run (a restart): appended, nothing lost
    code = EARLY.format(rank=1, logs=str(tmp_path), ts=None)
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True, timeout=60)
    text = (tmp_path / "native_rank1_TS.log").read_text()
    assert text.startswith(native1) and text.count("before the run TS") == 2
    assert not list(tmp_path.glob(".native*"))
