"""`--model=package.module:ClassName`, checked in the launcher without importing anything: the
module's file is found the way the import system would find it (no package `__init__` runs), and
its source is read for the name. Torch-free, so the launcher (`ae.job.launch`) stays light; the
ranks import the class (`ae.training.models.user`), and only that can tell whether it works.
"""

from __future__ import annotations

import ast
import difflib
import importlib.machinery
import os
import sys
from pathlib import Path


def split_path(path: str) -> tuple[str, str]:
    module, _, name = path.partition(":")
    return module, name


def _find_module_file(module: str, search: list[str]) -> Path | str | None:
    """The source file of `module` (a `.py`), None when it does not exist, or a note (str) when
    it exists but is no Python source (an extension, a namespace package) -- found part by part
    with the path finder, so no package `__init__` runs."""
    path: list[str] | None = search
    spec = None
    parts = module.split(".")
    for i in range(len(parts)):
        spec = importlib.machinery.PathFinder.find_spec(".".join(parts[: i + 1]), path)
        if spec is None:
            return None
        path = list(spec.submodule_search_locations or [])
        if i < len(parts) - 1 and not path:
            return None  # a plain module where a package was needed
    assert spec is not None
    if spec.origin is None or not spec.origin.endswith(".py"):
        return "not Python source"
    return Path(spec.origin)


def _top_level_names(tree: ast.Module) -> set[str] | None:
    """Names a module binds at its top level (also inside top-level if/try/with blocks); None
    when it has a `from x import *` (anything may be bound)."""
    names: set[str] = set()
    body = list(tree.body)
    while body:
        node = body.pop()
        if isinstance(node, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            names.add(node.name)
        elif isinstance(node, ast.Assign | ast.AnnAssign | ast.AugAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names |= {n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)}
        elif isinstance(node, ast.Import | ast.ImportFrom):
            for alias in node.names:
                if alias.name == "*":
                    return None
                names.add(alias.asname or alias.name.split(".")[0])
        elif isinstance(node, ast.If | ast.Try | ast.With):
            body += node.body + getattr(node, "orelse", []) + getattr(node, "finalbody", [])
            for handler in getattr(node, "handlers", []):
                body += handler.body
    return names


def import_search_path() -> list[str]:
    """Where the ranks find a user module: the working directory, then `sys.path`."""
    return [os.getcwd(), *sys.path]


def locate_class(path: str) -> str | None:
    """The problem with `package.module:ClassName`, or None when its module file exists and
    binds the name. Nothing is imported."""
    module, name = split_path(path)
    found = _find_module_file(module, import_search_path())
    if found is None and module.endswith(".py"):
        return f"model: {module!r} is a file name; name its module: --model={module[:-3]}:{name}"
    if found is None:
        return (
            f"model: no module {module!r} (looked in the working directory {os.getcwd()} and "
            "on PYTHONPATH)"
        )
    if isinstance(found, str):
        return None  # an extension or namespace package: only importing it can tell
    try:
        tree = ast.parse(found.read_text(), str(found))
    except (OSError, SyntaxError, ValueError) as e:
        return f"model: cannot read {found}: {type(e).__name__}: {e}"
    names = _top_level_names(tree)
    if names is not None and name not in names:
        near = difflib.get_close_matches(name, sorted(names), n=1, cutoff=0.6)
        near += [n for n in sorted(names) if n.lower() == name.lower() and n not in near]
        hint = f"; did you mean {module}:{near[0]}?" if near else ""
        return f"model: {found} defines no {name!r}{hint}"
    return None


def model_spelling_hint(value: str, builtins: tuple[str, ...]) -> str:
    """For a --model that is neither one of `builtins` nor `package.module:ClassName`: what it
    probably meant (a built-in misspelt, a dot before the class, a file path), or ""."""
    if near := difflib.get_close_matches(value, builtins, n=1, cutoff=0.6):
        return f" (did you mean {near[0]}?)"
    module, colon, name = value.rpartition(":")
    if colon and (module.endswith(".py") or "/" in module):  # a file path
        stem = Path(module).stem
        return (
            f" (a module, not a file: from the folder holding {Path(module).name}, or with it on "
            f"PYTHONPATH, --model={stem}:{name})"
        )
    if not colon and "." in value:
        module, _, name = value.rpartition(".")
        if name[:1].isupper():
            return f" (did you mean --model={module}:{name}? a colon before the class)"
    return ""
