"""The Flight Recorder on in a real process group, dumped, and read back by ae-diagnose's parser."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from ae.diagnose.collectives import read_dump
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
