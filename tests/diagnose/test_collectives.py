"""The Flight Recorder dumps aligned (ae.diagnose.collectives), on dumps of real runs.

The fixtures were written by ae itself on 2-rank gloo runs (tests/support/desync_models.py), the
dumps cut to their last 8 entries:
- `hang/`: `AE_FAULT=desync@train:rank=1:step=3:size=3224` with TinyAutoEncoder (3,224
  parameters, one gradient bucket): rank 1's extra all-reduce #49 paired with rank 0's gradient
  all-reduce, then the ranks disagreed at #50 (rank 0 in a barrier) until --pg_timeout;
- `abort/`: the logs of a run of `SmallExtraCollective` (rank 1 all-reduces 3 numbers once):
  gloo aborted rank 1 (SIGABRT, no dump of its own); rank 0 dumped when its socket closed.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pytest

from ae.diagnose.collectives import align, backend_words, find_mismatches
from ae.diagnose.flight_recorder import Dump, read_dump
from ae.diagnose.log_files import find_run
from ae.diagnose.report import diagnose, verdict_lines
from bench.synthetic_logs import TS, RankWriter, write_train_log

FIXTURES = Path(__file__).parent / "fixtures" / "collectives"
HANG_TS, ABORT_TS = "20261126_063959", "20261126_063933"


def hang_dumps() -> dict[int, Dump]:
    out = {}
    for rank in (0, 1):
        dump = read_dump(FIXTURES / "hang" / f"collectives_rank{rank}_{HANG_TS}.json", rank)
        assert dump is not None
        out[rank] = dump
    return out


def test_the_dump_is_read_as_calls_per_process_group_and_sequence_id() -> None:
    dumps = hang_dumps()
    calls = dumps[1].calls["0"]
    assert sorted(calls) == list(range(43, 51))
    extra = calls[49]
    assert (extra.op, extra.sizes, extra.dtypes) == ("all_reduce", [[3224]], ["Float"])
    assert extra.site().startswith("ae/forensics/faults.py:")  # no user frame: ae's own
    assert extra.site().endswith("(_injected_desync)")
    grad = dumps[0].calls["0"][49]  # DDP's gradient all-reduce: issued from autograd
    assert grad.site().startswith("torch/autograd/graph.py:") and grad.shape == extra.shape
    # The same shape: only their call sites tell the extra call from the gradient all-reduce.
    assert calls[50].key() == grad.key() == extra.key() and extra.site() != grad.site()
    assert dumps[0].reason == "failed: RuntimeError"


def test_an_extra_collective_is_found_by_its_call_site() -> None:
    """The ops first differ at #50 (rank 0 in its barrier, rank 1 in its gradient all-reduce);
    rank 1's #49 comes from a line rank 0 never called a collective from."""
    (m,) = align(hang_dumps())
    assert (m.kind, m.pg, m.seq, m.ranks) == ("extra", "0", 49, [1])
    assert [c.rank for c in m.others] == [0]
    assert "rank 1 issued a collective the others did not" in m.summary()


def test_different_sizes_at_the_same_id_are_a_mismatch() -> None:
    dumps = hang_dumps()
    for dump in dumps.values():  # both ranks call the same op from the same place...
        dump.calls["0"] = {s: c for s, c in dump.calls["0"].items() if s <= 48}
    three = dataclasses.replace(dumps[1].calls["0"][48], sizes=[[3]])
    dumps[1].calls["0"][48] = three  # ...with other sizes on rank 1
    (m,) = align(dumps)
    assert (m.kind, m.seq) == ("mismatch", 48)
    assert sorted(c.rank for c in [*m.calls, *m.others]) == [0, 1]
    assert "[3]" in m.summary() and "[1]" in m.summary()


def test_a_rank_behind_counts_only_when_every_rank_waits() -> None:
    dumps = hang_dumps()
    for dump in dumps.values():
        dump.calls["0"] = {s: c for s, c in dump.calls["0"].items() if s <= 48}
    del dumps[0].calls["0"][48]  # rank 0's last call is #47: it never joined #48
    assert align(dumps) == []  # a stalled rank is behind because it is stuck: not a mismatch
    (m,) = align(dumps, all_waiting=True)
    assert (m.kind, m.seq, m.ranks) == ("behind", 48, [0])
    assert m.calls[0].seq == 47 and m.others[0].seq == 48


def test_a_run_with_the_hang_dumps_names_the_extra_call(tmp_path: Path) -> None:
    """The dumps next to logs that say nothing of a mismatch: the verdict comes from them."""
    for path in (FIXTURES / "hang").iterdir():
        shutil.copy(path, tmp_path / path.name)
    doc = diagnose(find_run(tmp_path))
    (c,) = doc["culprits"]
    assert (c["rank"], c["cause"]) == (1, "collective mismatch")
    assert "#49 all_reduce [3224] Float at ae/forensics/faults.py:" in c["evidence"][0]["text"]
    (m,) = doc["collectives"]["mismatches"]
    assert (m["kind"], m["seq"], m["ranks"]) == ("extra", 49, [1])
    assert m["calls"][0]["sizes"] == [[3224]] and m["others"][0]["rank"] == 0
    assert [d["rank"] for d in doc["collectives"]["dumps"]] == [0, 1]


def test_a_rank_aborted_by_gloo_is_named_from_its_native_log_and_fatal_stack(
    tmp_path: Path,
) -> None:
    """Without a dump of the aborted rank: gloo's words, its main thread's call site, and the
    collective its peer was in."""
    for path in (FIXTURES / "abort").iterdir():
        shutil.copy(path, tmp_path / path.name)
    doc = diagnose(find_run(tmp_path))
    (c,) = doc["culprits"]
    assert (c["rank"], c["cause"], c["phase"]) == (1, "collective mismatch", "training step")
    site, native, peer = (e["text"] for e in c["evidence"])
    assert site.startswith("tests/support/desync_models.py:22 (loss) called all_reduce")
    assert "rank 0 was in #49 all_reduce [3224] Float" in site
    assert "collective mismatch in your code?" in native
    assert peer.startswith("rank 0: #49 all_reduce [3224] Float at torch/autograd/graph.py:")
    (m,) = doc["collectives"]["mismatches"]
    assert (m["kind"], m["ranks"]) == ("backend", [1])
    assert [(v["rank"], v["cause"]) for v in doc["victims"]] == [(0, "peer failure: RuntimeError")]
    lines = verdict_lines(doc)  # what the launcher prints
    assert lines[0].endswith("phase training step: collective mismatch")
    assert "desync_models.py:22 (loss) called all_reduce" in lines[1]


def test_a_torn_or_foreign_file_is_no_dump(tmp_path: Path) -> None:
    torn = tmp_path / "collectives_rank0_x.json"
    torn.write_text('{"entries": [')
    assert read_dump(torn, 0) is None
    torn.write_text(json.dumps({"no": "entries"}))
    assert read_dump(torn, 0) is None


def test_nccl_timeout_lines_align_like_one_call_dumps(tmp_path: Path) -> None:
    """No dumps (an NCCL build's ranks timed out): each rank's timeout line names the collective
    it waited in. (Written here in NCCL's wording: this repository's tests have no GPU.)"""

    def native(rank: int, seq: int, numel: int) -> list[Path]:
        path = tmp_path / f"native_rank{rank}_T.log"
        path.write_text(
            f"[rank{rank}]:[E ProcessGroupNCCL.cpp:616] [Rank {rank}] Watchdog caught collective "
            f"operation timeout: WorkNCCL(SeqNum={seq}, OpType=ALLREDUCE, NumelIn={numel}, "
            f"NumelOut={numel}, Timeout(ms)=600000) ran for 600042 milliseconds before timing "
            "out.\n"
        )
        return [path]

    same_id = backend_words({0: native(0, 12, 3224), 1: native(1, 12, 3)})
    (m,) = find_mismatches({}, same_id, {})
    assert (m.kind, m.seq) == ("mismatch", 12)
    assert {c.sizes[0][0] for c in [*m.calls, *m.others]} == {3224, 3}
    assert all("Watchdog caught collective operation timeout" in e.text for e in m.evidence)
    behind = backend_words({0: native(0, 13, 3224), 1: native(1, 12, 3224)})
    (m,) = find_mismatches({}, behind, {})
    assert (m.kind, m.seq, m.ranks) == ("behind", 13, [1])


@pytest.mark.parametrize("ended", [False, True], ids=["live", "after_pg_timeout"])
def test_a_mismatch_stays_the_headline_after_its_rank_exited(tmp_path: Path, ended: bool) -> None:
    """The bucket-size extra all-reduce of `hang/`: both ranks wait in a collective. Read live,
    the mismatch is the verdict; read after --pg_timeout ended the job (torchrun saw rank 1 exit 1
    first, no exit line of its own), the mismatch is still the headline, the exit in its rule."""
    for rank in (0, 1):
        dump = FIXTURES / "hang" / f"collectives_rank{rank}_{HANG_TS}.json"
        shutil.copy(dump, tmp_path / f"collectives_rank{rank}_{TS}.json")
    w0, w1 = (RankWriter(tmp_path, rank, 2) for rank in (0, 1))
    write_train_log(tmp_path, 2)
    for w in (w0, w1):
        w.start()
        w.steps(1, 3)
        w.stall("training step", 3, 3.0, collective="yes (all_reduce)",
                frame="_engine_run_backward (torch/autograd/graph.py:979)")  # fmt: skip
        w.flush()
    if ended:
        report = ["Root Cause (first observed failure):", "[0]:",
                  "  rank      : 1 (local_rank: 1)", "  exitcode  : 1 (pid: 4194001)"]  # fmt: skip
        (tmp_path / f"launcher_{TS}.log").write_text("\n".join(report) + "\n")
    doc = diagnose(find_run(tmp_path))
    (c,) = doc["culprits"]
    assert (c["rank"], c["cause"]) == (1, "collective mismatch"), c
    assert verdict_lines(doc)[0].endswith("collective mismatch")
    if ended:
        assert doc["status"] == "failed"
        assert c["rule"].endswith("then its process ended: exited 1, says torchrun")
        assert c["evidence"][-1]["text"] == "exitcode  : 1 (pid: 4194001)"
    else:
        assert doc["status"] == "hung"
