"""The Flight Recorder on in a real process group, dumped, and read back by ae-diagnose's parser."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import torch

from ae.diagnose.flight_recorder import read_dump
from ae.forensics import flight_recorder
from tests.support.runs import ROOT

# One gloo process: the recorder must be on before the process group exists, so in a fresh
# interpreter (this one may have made process groups already).
SCRIPT = """
import sys, torch, torch.distributed as dist
from pathlib import Path
from ae.forensics import flight_recorder
assert flight_recorder.dump("early") is None  # nothing before enable and a process group
flight_recorder.enable(Path(sys.argv[1]), 0, "T")
dist.init_process_group("gloo", init_method="tcp://127.0.0.1:0", rank=0, world_size=1)
for _ in range(5):
    dist.all_reduce(torch.zeros(7))
def my_sync():
    dist.broadcast(torch.zeros(2, dtype=torch.long), 0)
my_sync()
print(flight_recorder.dump("requested"))
dist.destroy_process_group()
"""


def test_a_dump_holds_each_collective_with_its_call_site(tmp_path: Path) -> None:
    res = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(tmp_path)],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr
    path = Path(res.stdout.strip())
    assert path == flight_recorder.collectives_path(tmp_path, 0, "T")
    doc = json.loads(path.read_text())
    assert doc["reason"] == "requested" and doc["rank"] == 0
    assert {e["recorder"] for e in doc["entries"]} == {"generic"}  # a CPU wheel: no NCCL one
    dump = read_dump(path, 0)
    assert dump is not None
    (calls,) = dump.calls.values()
    assert [c.op for c in calls.values()] == ["all_reduce"] * 5 + ["broadcast"]
    last = dump.last(next(iter(dump.calls)))
    assert last is not None and last.sizes == [[2]] and last.dtypes == ["Long"]
    assert last.site() == "<string>:11 (my_sync)"  # the innermost frame outside torch
    assert "Collectives dumped (requested): 6 entries" in res.stderr


def test_a_torch_older_than_the_gloo_recorder_is_warned_about_in_one_line() -> None:
    line = flight_recorder.old_torch_warning("2.7.1+cu126")
    assert line is not None and "\n" not in line
    assert line.startswith("torch 2.7.1+cu126 is older than 2.8: ") and "gloo" in line
    assert flight_recorder.old_torch_warning("2.8.0") is None
    assert flight_recorder.old_torch_warning("2.11.0a0+git1234") is None
    assert flight_recorder.old_torch_warning(torch.__version__) is None  # the torch tested here


def test_pyprojects_torch_floor_is_the_first_gloo_recorder() -> None:
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    (torch_dep,) = [d for d in deps if re.match(r"torch\b", d)]
    floor = ".".join(map(str, flight_recorder.GLOO_RECORDED_SINCE))
    assert torch_dep == f"torch>={floor}"
