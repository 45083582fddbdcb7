"""Each check of the docs (tests/doc_checks.py, tests/doc_log_greps.py) fed an injected
mistake: a flag, a grep, a command, a path, a module table that is wrong is caught, and the
right one passes."""

from __future__ import annotations

from pathlib import Path

from tests.doc_checks import command_problems, flag_problems, module_table_problems, path_problems
from tests.doc_log_greps import grep_problems, grep_table, written_lines
from tests.support.runs import ROOT


# --- each check fails on an injected mistake ----------------------------------------------------
def test_the_checks_catch_injected_mistakes(tmp_path: Path) -> None:
    assert flag_problems("Train with `--bogus_flag=3`.") == [
        "line 1: --bogus_flag is no flag of any command"
    ]
    assert flag_problems("```\nae-diagnose runs/ae/logs --batch_size=3\n```") == [
        "line 2: --batch_size is no flag of ae-diagnose"
    ]
    assert flag_problems("```\n./train_ae.sh --batch_size=3 --debug\n```") == []

    lines = written_lines()
    table = "| command | finds |\n|---|---|\n| `grep TELEPORTED train_*.log` | moved ranks |\n"
    (row,) = grep_table(table)
    assert grep_problems(row, lines)  # a line nobody writes
    assert grep_problems('grep "Training step" train_*.log', lines)  # not in that file
    assert grep_problems('grep "ERROR.*Processing" debug_rank*.log', lines)  # not at that level
    assert grep_problems('grep -e "PREEMPTED" -e "NOPE" train_*.log', lines)  # one alternative
    assert grep_problems('grep "Training step" debug_rank0_*.log', lines) == []

    assert command_problems("Encode with `ae-teleport CKPT SPEC OUT`.") == [
        "line 1: ae-teleport is not installed by pyproject.toml"
    ]
    assert command_problems("`ae-teleport CKPT SPEC OUT` (planned)") == []

    doc = ROOT / "docs" / "x.md"
    assert path_problems(doc, "See ../elsewhere/SPEC.md for more.")
    assert path_problems(doc, "See [it](../../SPEC.md).")
    assert path_problems(doc, "Read `ae/dataset.py` and `ae.shard_spec`.") == [
        "line 1: ae/dataset.py: no such file or folder in the repo",
        "line 1: ae.shard_spec: ae defines no shard_spec",
    ]
    assert path_problems(doc, "[grep](CONTRACT.md#no-such-heading)")
    assert path_problems(doc, "[ok](../ae/data/README.md), `ae.log_lines.HEARTBEAT_FIELDS`") == []

    job = ROOT / "ae" / "job"
    head = "| module | what it does |\n|---|---|\n"
    rows = "".join(f"| `{m.name}` | x |\n" for m in job.glob("*.py") if m.stem != "__init__")
    assert module_table_problems(head + rows, job) == []
    assert module_table_problems(head + rows + "| `gone.py` | x |\n", job) == [
        "gone.py: no such module in ae/job"
    ]
    assert module_table_problems(head + rows + "| `launch.py` | again |\n", job) == [
        "launch.py is listed twice"
    ]
    assert "topology.py is not in the table" in module_table_problems(
        head + "| `launch.py`, `encode.py` | x |\n", job
    )
    assert module_table_problems("no table", job) == ["0 module tables (want one)"]
