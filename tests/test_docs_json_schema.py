"""The `ae-diagnose --json` schema of docs/CONTRACT.md against a real diagnosis: the keys of
its example are the keys ae-diagnose prints."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

from ae.diagnose.attempts import diagnose_job
from ae.diagnose.log_files import find_run
from ae.log_lines import BAD_SAMPLE, COLLECTIVES_FILE, LOSS_SPIKE, NONFINITE
from bench.synthetic_logs import TS, RankWriter, write_heartbeat, write_train_log
from tests.doc_checks import CONTRACT
from tests.support.runs import ROOT

COLLECTIVES_FIXTURE = ROOT / "tests" / "diagnose" / "fixtures" / "collectives" / "hang"


def test_json_schema_in_the_contract_is_what_ae_diagnose_prints(tmp_path: Path) -> None:
    """Keys of the `--json` example in docs/CONTRACT.md == keys of a real diagnosis (a synthetic
    hung run with a bad shard and the Flight Recorder dumps of a real collective mismatch,
    diagnosed with --tail)."""
    write_train_log(tmp_path, 2)
    for rank in (0, 1):
        dump = COLLECTIVES_FIXTURE / f"collectives_rank{rank}_20261126_063959.json"
        shutil.copy(dump, tmp_path / COLLECTIVES_FILE.format(rank=rank, ts=TS))
    for rank in (0, 1):
        w = RankWriter(tmp_path, rank, 2)
        w.start()
        w.steps(1, 6)
        w.log(BAD_SAMPLE.format(key="0007", url="/d/a-000001.tar", reason="bad"), "ERROR")
        w.log(
            LOSS_SPIKE.format(
                loss=4.2,
                rank=rank,
                step=3,
                epoch=0,
                batch=2,
                ratio=14.0,
                mean=0.3,
                samples="shard /d/a-000001.tar, keys [0003]",
            ),
            "WARNING",
        )
        w.log(
            NONFINITE.format(
                value="loss=nan",
                rank=rank,
                step=5,
                epoch=0,
                batch=4,
                samples="shard /d/a-000001.tar, keys [0009]",
            ),
            "ERROR",
        )
        w.stall("training step", 6, 10.0, collective="no" if rank == 0 else "yes (allreduce)")
        w.flush()
        recent = {"window_s": 30.0, "steps": 6, "step_ms": 20.0, "own_ms": 15.0, "data_ms": 5.0,
                  "compute_ms": 10.0, "sync_ms": 5.0}  # fmt: skip
        write_heartbeat(tmp_path, rank, 2, pid=1, t=w.t, phase="training step", step=6,
                        timing={"recent": recent, "epoch": recent})  # fmt: skip
    doc = diagnose_job(find_run(tmp_path), tail=2)
    # every part of the schema is there
    assert doc["culprits"] and doc["data_errors"]["shards"] and doc["collectives"]["mismatches"]
    assert doc["bound"] is not None and doc["ranks"][0]["step_time"] is not None

    def keys(value: object, parent: str = "") -> set[str]:
        if isinstance(value, list):
            return set().union(*(keys(v, parent) for v in value))
        if isinstance(value, dict) and parent != "shard_plan_mismatch":  # its keys are data
            return set(value).union(*(keys(v, k) for k, v in value.items()))
        return set()

    block = CONTRACT.read_text().split("```jsonc", 1)[1].split("```", 1)[0]
    assert set(re.findall(r'"(\w+)":', block)) == keys(doc)
