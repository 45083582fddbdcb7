"""The docs against the code: README.md, docs/*.md, ae/**/README.md and bench/README.md must name
only flags, log lines, commands and paths that exist, and stay short.

No process is launched: flags of the commands are read from their argparse calls (AST), log
lines from ae.log_lines and the code that writes them (the checks: tests/doc_checks.py and
tests/doc_log_greps.py; each is fed an injected mistake in tests/test_docs_injected_mistakes.py;
the `--json` schema is tests/test_docs_json_schema.py).
"""

from __future__ import annotations

import re

from tests.doc_checks import (
    CONTRACT,
    DOCS,
    README_MAX_LINES,
    command_problems,
    console_scripts,
    flag_problems,
    module_file,
    module_table_problems,
    path_problems,
    rel,
    top_level_names,
)
from tests.doc_log_greps import grep_problems, grep_table, log_greps, written_lines
from tests.support.runs import ROOT


# --- the checks ---------------------------------------------------------------------------------
def test_every_flag_named_in_the_docs_exists() -> None:
    problems = [f"{rel(d)} {p}" for d in DOCS for p in flag_problems(d.read_text())]
    assert problems == []


def test_every_grep_table_row_finds_a_line_that_ae_writes() -> None:
    lines = written_lines()
    rows = grep_table(CONTRACT.read_text())
    assert len(rows) >= 15, rows  # the table was found and read
    assert [p for row in rows for p in grep_problems(row, lines)] == []


def test_every_other_grep_of_the_logs_in_the_docs_finds_a_line() -> None:
    lines = written_lines()
    greps = [(d, g) for d in DOCS for g in log_greps(d.read_text())]
    assert len(greps) >= 5, greps
    assert [f"{rel(d)}: {p}" for d, g in greps for p in grep_problems(g, lines)] == []


def test_one_grep_table_in_the_repo() -> None:
    headers = [
        rel(d)
        for d in DOCS
        for line in d.read_text().splitlines()
        if re.match(r"\|\s*command\s*\|\s*finds\s*\|", line)
    ]
    assert headers == ["docs/CONTRACT.md"]


def test_every_console_command_named_is_installed() -> None:
    for name, target in console_scripts().items():
        module, func = target.split(":")
        assert func in top_level_names(module_file(module)), name
    assert [f"{rel(d)} {p}" for d in DOCS for p in command_problems(d.read_text())] == []


def test_no_path_outside_the_repo_and_every_repo_path_exists() -> None:
    assert [f"{rel(d)} {p}" for d in DOCS for p in path_problems(d, d.read_text())] == []


def test_every_package_readme_lists_exactly_its_modules() -> None:
    readmes = sorted(ROOT.joinpath("ae").rglob("README.md"))
    packages = {rel(init.parent) for init in ROOT.joinpath("ae").glob("*/__init__.py")}
    assert {"ae/cli", "ae/config", "ae/data", "ae/diagnose", "ae/job", "ae/rank"} <= packages
    assert packages <= {rel(r.parent) for r in readmes}  # every sub-package of ae has one
    assert [
        f"{rel(r)}: {p}" for r in readmes for p in module_table_problems(r.read_text(), r.parent)
    ] == []


def test_readme_is_a_front_door() -> None:
    assert len((ROOT / "README.md").read_text().splitlines()) <= README_MAX_LINES


def test_package_readmes_say_what_the_package_is_in_few_lines() -> None:
    """Reference detail lives in docstrings or docs/; a package README stays short."""
    readmes = [*sorted(ROOT.joinpath("ae").rglob("README.md")), ROOT / "bench" / "README.md"]
    assert len(readmes) >= 9, readmes  # the READMEs were found
    lengths = {rel(r): len(r.read_text().splitlines()) for r in readmes}
    assert {name: n for name, n in lengths.items() if n > README_MAX_LINES} == {}
