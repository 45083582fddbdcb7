"""The docs against the code: README.md, docs/*.md, ae/**/README.md and bench/README.md must name
only flags, log lines, commands, paths and JSON keys that exist.

Each check is a function from a document's text to a list of problems, so the last tests can feed
each one an injected mistake and see it caught. No process is launched: flags of the commands are
read from their argparse calls (AST), log lines from ae.log_lines and the code that writes them.
"""

from __future__ import annotations

import ast
import importlib.util
import re
import shlex
import shutil
import string
import tomllib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from ae import log_lines
from ae.config import FIELDS
from ae.diagnose.attempts import diagnose_job
from ae.diagnose.log_files import find_run
from ae.log_lines import (
    BAD_SAMPLE,
    COLLECTIVES_FILE,
    LOSS_SPIKE,
    NONFINITE,
    RECORD_PATTERN,
    LineFormat,
    epoch_marker,
)
from bench.synthetic_logs import TS, RankWriter, write_heartbeat, write_train_log
from tests.support.runs import ROOT

COLLECTIVES_FIXTURE = ROOT / "tests" / "diagnose" / "fixtures" / "collectives" / "hang"

CONTRACT = ROOT / "docs" / "CONTRACT.md"
DOCS = sorted(
    {ROOT / "README.md", ROOT / "bench" / "README.md", *ROOT.joinpath("docs").glob("*.md")}
    | set(ROOT.joinpath("ae").rglob("README.md"))
)
README_MAX_LINES = 150


def rel(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


@dataclass(frozen=True)
class Snippet:
    """A piece of a doc that may hold a command: a line of a fenced code block, or an inline
    code span (`code`) of a prose line."""

    line: int
    text: str


def code_snippets(text: str) -> Iterator[Snippet]:
    fenced = False
    for n, line in enumerate(text.splitlines(), 1):
        if line.lstrip().startswith("```"):
            fenced = not fenced
        elif fenced:
            yield Snippet(n, line)
        else:
            for span in re.findall(r"`([^`]+)`", line):
                yield Snippet(n, span)


# --- (a) flags ----------------------------------------------------------------------------------
FLAG = re.compile(r"(?<![\w-])--([A-Za-z][\w-]*)")
# Flags of tools that are not ours, or of our shell scripts (no argparse to read them from).
TOOL_FLAGS = {
    "help",  # every command answers --help
    "install-only",  # ./train_ae.sh: stop after installing (run_tests.sh uses it)
    "nproc_per_node",  # torchrun's, for those who run train_ae.py with torchrun themselves
    "shm-size",  # docker run's, for the shared memory of dataloader workers
    # sbatch/srun's, in the SLURM examples (docs/RUNS.md, README.md)
    "nodes", "ntasks-per-node", "gpus-per-node", "cpus-per-task", "job-name", "output",
    "signal", "full", "kill-on-bad-exit", "requeue",
    "logdir", "backend-store-uri",  # tensorboard's and `mlflow ui`'s, to open a run's metrics
    "no-index", "no-deps", "target",  # pip's, installing wheels carried to a GPU lease (bench/)
}  # fmt: skip


def argparse_flags(path: Path) -> set[str]:
    """The `--flags` of every `add_argument(...)` call in a module, read without importing it."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "add_argument"
        ):
            for arg in node.args:
                if isinstance(arg, ast.Constant) and str(arg.value).startswith("--"):
                    out.add(str(arg.value)[2:])
    return out


def console_scripts() -> dict[str, str]:
    """`ae-x` -> `module:function`, from pyproject.toml."""
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    return pyproject["project"]["scripts"]


def module_file(module: str) -> Path:
    spec = importlib.util.find_spec(module)
    assert spec is not None and spec.origin is not None, module
    return Path(spec.origin)


# An entry point whose arguments are declared elsewhere: ae-encode's ranks parse them too.
PARSER_OF = {"ae.cli.encode": "ae.job.encode"}


def command_flags() -> dict[str, set[str]]:
    """Command name as the docs write it -> its flags. The launcher's are the config's."""
    launcher = set(FIELDS) | {"help"}
    flags: dict[str, set[str]] = {"train_ae.sh": launcher | {"install-only"}}
    for name, target in console_scripts().items():
        module = target.split(":")[0]
        parser = PARSER_OF.get(module, module)
        own = launcher if module == "ae.cli.launch" else argparse_flags(module_file(parser))
        flags[name] = own | {"help"}
        flags[module] = flags[name]  # `python -m ae.cli.shards ...`
    flags["ae.diagnose"] = flags["ae-diagnose"]  # `python -m ae.diagnose` runs its cli
    return flags


def known_flags() -> set[str]:
    """Any flag that some command of ours (or a tool in TOOL_FLAGS) has."""
    bench = set().union(*(argparse_flags(p) for p in ROOT.joinpath("bench").glob("*.py")))
    return set().union(*command_flags().values()) | bench | TOOL_FLAGS


def flag_problems(text: str) -> list[str]:
    """Every `--flag` exists; in a snippet that runs one of our commands, it is that command's."""
    problems = []
    known, per_command = known_flags(), command_flags()
    names = sorted(per_command, key=len, reverse=True)
    command_re = re.compile(r"(?:^|[\s/])(" + "|".join(map(re.escape, names)) + r")(?![\w.-])")
    for n, line in enumerate(text.splitlines(), 1):
        for flag in FLAG.findall(line):
            if flag not in known:
                problems.append(f"line {n}: --{flag} is no flag of any command")
    for s in code_snippets(text):
        if (m := command_re.search(s.text)) is None:
            continue
        own = per_command[m[1]]
        for flag in FLAG.findall(s.text[m.end() :]):
            if flag in known and flag not in own:
                problems.append(f"line {s.line}: --{flag} is no flag of {m[1]}")
    return problems


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


# --- (c) console commands -----------------------------------------------------------------------
COMMAND = re.compile(r"(?<![\w/.-])ae-[a-z]+(?![\w-])")


def command_problems(text: str) -> list[str]:
    """Every `ae-...` command named is installed by pyproject.toml, or its line says planned."""
    installed = set(console_scripts())
    problems = []
    for n, line in enumerate(text.splitlines(), 1):
        for name in COMMAND.findall(line):
            if name not in installed and "planned" not in line.lower():
                problems.append(f"line {n}: {name} is not installed by pyproject.toml")
    return problems


# --- (d) paths: nothing outside the repo, every repo path and link exists ------------------------
OUTSIDE = re.compile(r"/work/|shared/SPEC|SPEC\.md|\.\./")
LINK = re.compile(r"\]\(([^)\s]+)\)")
REPO_PATH = re.compile(r"(?<![\w./~-])((?:ae|tests|bench|logging_cfg|docs)/[\w./-]*)")
MODULE = re.compile(r"(?<![\w./-])((?:ae|logging_cfg)(?:\.[A-Za-z_]\w*)+)")


def slug(heading: str) -> str:
    """GitHub's anchor of a heading."""
    text = heading.strip().lstrip("#").strip().replace("`", "").lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def top_level_names(path: Path) -> set[str]:
    names = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.FunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Assign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names |= {t.id for t in targets if isinstance(t, ast.Name)}
        elif isinstance(node, ast.ImportFrom | ast.Import):
            names |= {a.asname or a.name for a in node.names}
    return names


def module_problem(dotted: str) -> str | None:
    """`ae.data.stream` or `ae.log_lines.HEARTBEAT_FIELDS`: a module, or a name defined in one."""
    parts = dotted.split(".")
    for k in range(len(parts), 0, -1):
        try:
            spec = importlib.util.find_spec(".".join(parts[:k]))
        except ModuleNotFoundError:
            spec = None
        if spec is None or spec.origin is None:
            continue
        if k == len(parts) or parts[k] in top_level_names(Path(spec.origin)):
            return None
        return f"{dotted}: {'.'.join(parts[:k])} defines no {parts[k]}"
    return f"{dotted}: no such module"


def path_problems(doc: Path, text: str) -> list[str]:
    problems = []
    for n, line in enumerate(text.splitlines(), 1):
        links = LINK.findall(line)
        bare = LINK.sub("", line)
        if m := OUTSIDE.search(bare):
            problems.append(f"line {n}: {m[0]!r} points outside the repo")
        for target in links:
            if re.match(r"[a-z]+://", target):
                continue
            file, _, anchor = target.partition("#")
            dest = (doc.parent / file).resolve() if file else doc
            if not dest.is_relative_to(ROOT):
                problems.append(f"line {n}: link {target} points outside the repo")
            elif not dest.exists():
                problems.append(f"line {n}: link {target}: no such file")
            elif anchor and dest.suffix == ".md":
                heads = [slug(h) for h in dest.read_text().splitlines() if h.startswith("#")]
                if anchor not in heads:
                    problems.append(f"line {n}: link {target}: no such heading")
        for path in REPO_PATH.findall(bare):
            path = path.rstrip(".")
            if not path.startswith("bench/results") and not (ROOT / path).exists():
                problems.append(f"line {n}: {path}: no such file or folder in the repo")
        for dotted in MODULE.findall(bare):
            if (problem := module_problem(dotted.rstrip("."))) is not None:
                problems.append(f"line {n}: {problem}")
    return problems


MODULE_TABLE = re.compile(r"\|\s*module\s*\|")


def module_table_problems(text: str, folder: Path) -> list[str]:
    """A package README's module table (`| module | ... |`, one per README) lists exactly the
    folder's modules (`x.py`, `__init__.py` aside) and sub-packages (`name/`), in the first
    column, each in backticks."""
    lines = text.splitlines()
    heads = [n for n, line in enumerate(lines) if MODULE_TABLE.match(line)]
    if len(heads) != 1:
        return [f"{len(heads)} module tables (want one)"]
    listed: list[str] = []
    for line in lines[heads[0] + 2 :]:
        if not line.startswith("|"):
            break
        listed += re.findall(r"`([\w./]+)`", line.split("|")[1])
    present = {p.name for p in folder.glob("*.py") if p.name != "__init__.py"}
    present |= {d.name + "/" for d in folder.iterdir() if (d / "__init__.py").is_file()}
    problems = [f"{name} is not in the table" for name in sorted(present - set(listed))]
    problems += [
        f"{name}: no such module in {rel(folder)}" for name in sorted(set(listed) - present)
    ]
    problems += [
        f"{name} is listed twice" for name in sorted({n for n in listed if listed.count(n) > 1})
    ]
    return problems


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
    readmes = sorted(ROOT.joinpath("ae").rglob("README.md"))
    assert len(readmes) >= 8, readmes  # the READMEs were found
    lengths = {rel(r): len(r.read_text().splitlines()) for r in readmes}
    assert {name: n for name, n in lengths.items() if n > README_MAX_LINES} == {}


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
        write_heartbeat(tmp_path, rank, 2, pid=1, t=w.t, phase="training step", step=6)
    doc = diagnose_job(find_run(tmp_path), tail=2)
    # every part of the schema is there
    assert doc["culprits"] and doc["data_errors"]["shards"] and doc["collectives"]["mismatches"]

    def keys(value: object, parent: str = "") -> set[str]:
        if isinstance(value, list):
            return set().union(*(keys(v, parent) for v in value))
        if isinstance(value, dict) and parent != "shard_plan_mismatch":  # its keys are data
            return set(value).union(*(keys(v, k) for k, v in value.items()))
        return set()

    block = CONTRACT.read_text().split("```jsonc", 1)[1].split("```", 1)[0]
    assert set(re.findall(r'"(\w+)":', block)) == keys(doc)


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
