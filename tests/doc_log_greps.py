"""The greps of the docs against the lines ae writes: every LineFormat that some code logs, as
the record lines the sinks write, at each level and in which log file (read from the source,
AST); the grep commands of docs/CONTRACT.md's table and of every other doc; and whether each
alternative of a grep finds a written line in the file it searches."""

from __future__ import annotations

import ast
import re
import shlex
import string
from dataclasses import dataclass
from pathlib import Path

from ae import log_lines
from ae.log_lines import RECORD_PATTERN, LineFormat, epoch_marker
from tests.doc_checks import code_snippets
from tests.support.runs import ROOT

# --- (b) the grep table and every other grep of the logs ----------------------------------------
LEVELS = {"DEBUG": 10, "INFO": 20, "WARNING": 30, "ERROR": 40, "CRITICAL": 50}


@dataclass(frozen=True)
class Writer:
    """A function that logs a LineFormat: at which levels, and whether through `main_log` (the
    train log, from rank 0) -- read from the source, so a line nobody writes has no writer."""

    levels: frozenset[str]
    main: bool


def line_formats() -> dict[str, LineFormat]:
    return {k: v for k, v in vars(log_lines).items() if isinstance(v, LineFormat)}


def writers() -> dict[str, list[Writer]]:
    """LineFormat name -> the functions that log it. A function that returns a formatted line
    without logging it (`epoch_marker`, `effective_lr_line`, `_fatal`...) passes it on to its
    callers."""
    names = set(line_formats())

    def formats_and_calls(nodes: list[ast.AST]) -> tuple[set[str], set[str]]:
        formats, calls = set(), set()
        for sub in (s for node in nodes for s in ast.walk(node)):
            if isinstance(sub, ast.Attribute) and sub.attr == "format":
                if isinstance(sub.value, ast.Name):
                    formats |= {sub.value.id} & names
            elif isinstance(sub, ast.Call):
                calls.add(getattr(sub.func, "id", None) or getattr(sub.func, "attr", ""))
        return formats, calls

    funcs = []  # (name, formats, calls, returned formats, returned calls, levels, main)
    files = [*ROOT.joinpath("ae").rglob("*.py"), *ROOT.joinpath("logging_cfg").rglob("*.py")]
    for path in files:
        if "diagnose" in path.relative_to(ROOT).parts:  # the reader
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            levels, main = set(), False
            for sub in ast.walk(node):
                if isinstance(sub, ast.Attribute) and sub.attr.upper() in LEVELS:
                    levels |= {sub.attr.upper()} if sub.attr.islower() else set()
                elif isinstance(sub, ast.Name):
                    main |= sub.id == "main_log"
                    levels |= {"DEBUG"} if sub.id == "debug_line" else set()
            returns = [n for n in ast.walk(node) if isinstance(n, ast.Return)]
            funcs.append(
                (node.name, *formats_and_calls([node]), *formats_and_calls(returns), levels, main)
            )
    provides: dict[str, set[str]] = {}
    changed = True
    while changed:  # formatters: what they return goes to whoever calls them
        changed = False
        for name, _, _, ret_formats, ret_calls, _, _ in funcs:
            new = ret_formats.union(*(provides.get(c, set()) for c in ret_calls))
            if not new <= provides.get(name, set()):
                provides.setdefault(name, set()).update(new)
                changed = True
    out: dict[str, list[Writer]] = {}
    for _, formats, calls, _, _, levels, main in funcs:
        if levels:
            for fmt in formats.union(*(provides.get(c, set()) for c in calls)):
                out.setdefault(fmt, []).append(Writer(frozenset(levels), main))
    return out


def sample_messages(name: str, fmt: LineFormat) -> list[str]:
    if fmt is log_lines.MARKER:  # its name is free text: the epoch markers fill it in
        stages = [(s, e) for s in ("TRAINING", "VALIDATION") for e in ("START", "END")]
        return [epoch_marker(3, stage, edge) for stage, edge in stages]
    fields = [f for _, f, _, _ in string.Formatter().parse(fmt.template) if f]
    by_type = {"int": "7", "float": "0.25"}
    return [fmt.format(**{f: by_type.get(fmt.types.get(f, "word"), f) for f in fields})]


@dataclass(frozen=True)
class LogLine:
    fmt: str
    record: str  # the whole line, as the sinks write it
    in_train_log: bool
    in_debug_log: bool = True


def written_lines() -> list[LogLine]:
    """Every LineFormat that some code logs, as full record lines at each level it is logged."""
    out = []
    found = writers()
    for name, fmt in line_formats().items():
        for w in found.get(name, []):
            for level in w.levels:
                for message in sample_messages(name, fmt):
                    record = f"2026-11-23 09:45:09.368 | {level:<8} | [Rank 0/2] {message}"
                    assert RECORD_PATTERN.match(record), record  # the layout the sinks write
                    train = LEVELS[level] >= LEVELS["WARNING"] or w.main
                    out.append(LogLine(name, record, train))
    return out


def bre_to_python(pattern: str) -> str:
    """A grep basic regular expression (no alternation: split at `\\|` first) as Python's."""
    out, i = [], 0
    while i < len(pattern):
        c = pattern[i]
        if c == "\\" and i + 1 < len(pattern):
            nxt = pattern[i + 1]
            out.append(nxt if nxt in "(){}+?" else "\\" + nxt)
            i += 2
            continue
        out.append(re.escape(c) if c in "(){}+?|" else c)
        i += 1
    return "".join(out)


def parse_grep(command: str) -> tuple[list[str], list[str]] | None:
    """(alternatives, files) of `grep [options] PATTERN FILE...` / `grep -e P -e Q FILE...`."""
    try:
        words = shlex.split(command, comments=True)
    except ValueError:
        return None
    if not words or words[0] != "grep":
        return None
    patterns, rest, i = [], [], 1
    while i < len(words):
        if words[i] == "-e" and i + 1 < len(words):
            patterns.append(words[i + 1])
            i += 2
            continue
        if not words[i].startswith("-"):
            rest.append(words[i])
        i += 1
    if not patterns and rest:
        patterns, rest = [rest[0]], rest[1:]
    return [alt for p in patterns for alt in p.split("\\|")], rest


def grep_problems(command: str, lines: list[LogLine]) -> list[str]:
    """Each alternative of the grep finds some written line, in the log file it searches."""
    parsed = parse_grep(command)
    if parsed is None:
        return [f"{command!r}: not a grep command"]
    alternatives, files = parsed
    names = [Path(f).name for f in files]
    train = any(n.startswith("train_") for n in names)
    debug = any(n.startswith("debug_rank") for n in names)
    if not (train or debug):
        return [f"{command!r}: greps no train_*.log or debug_rank*.log"]
    problems = []
    for alt in alternatives:
        regex = re.compile(bre_to_python(alt))
        if not any(
            regex.search(ln.record) and ((train and ln.in_train_log) or (debug and ln.in_debug_log))
            for ln in lines
        ):
            where = "train log" if train else "debug log"
            problems.append(f"{command!r}: no line that ae writes to the {where} matches {alt!r}")
    return problems


def grep_table(text: str) -> list[str]:
    """The commands of the `| command | finds |` table."""
    rows, inside = [], False
    for line in text.splitlines():
        if re.match(r"\|\s*command\s*\|\s*finds\s*\|", line):
            inside = True
        elif inside and line.startswith("|"):
            cell = re.split(r"(?<!\\)\|", line)[1]
            if not set(cell.strip()) <= set("-: "):
                m = re.search(r"`([^`]+)`", cell)
                rows.append(m[1] if m else cell.strip())
        else:
            inside = False
    return rows


def log_greps(text: str) -> list[str]:
    """Every other grep of the run's log files in a doc (code lines and inline code)."""
    out = []
    for s in code_snippets(text):
        command = s.text.strip()
        if command.startswith("grep ") and re.search(r"(train_|debug_rank)\S*\.log", command):
            out.append(command)
    return out
