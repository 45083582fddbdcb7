"""The checks of the docs against the code, each a function from a document's text to a list of
problems: every `--flag` is a flag of the command it follows (read from the argparse calls,
AST), every `ae-...` command is installed, no path points outside the repo and every repo path,
link and module named exists, a package README's module table lists exactly its modules. And
the documents checked: README.md, docs/*.md, ae/**/README.md, bench/README.md."""

from __future__ import annotations

import ast
import importlib.util
import re
import tomllib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from ae.config import FIELDS
from tests.support.runs import ROOT

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
    "signal", "full", "kill-on-bad-exit", "requeue", "open-mode",
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
PARSER_OF = {"ae.cli.encode": "ae.job.encode_args"}


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
