"""Every third-party package that ae or logging_cfg imports is declared in pyproject.toml."""

from __future__ import annotations

import ast
import re
import sys
import tomllib

from tests.support.runs import ROOT

# Import names that differ from the distribution's name.
DISTRIBUTION = {"PIL": "pillow", "yaml": "pyyaml"}


def imported_packages(sources: dict[str, str]) -> dict[str, str]:
    """Top-level package -> `file:line` of its first import, for each package that is neither
    the standard library nor the project's own."""
    found: dict[str, str] = {}
    for path, text in sources.items():
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
                names = [node.module]
            else:
                continue
            for name in names:
                top = name.split(".")[0]
                if top not in sys.stdlib_module_names and top not in ("ae", "logging_cfg"):
                    found.setdefault(top, f"{path}:{node.lineno}")
    return found


def declared() -> set[str]:
    """The distributions pyproject.toml names: dependencies and optional extras."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = [s for group in project["optional-dependencies"].values() for s in group]
    specs = [*project["dependencies"], *extras]
    return {re.match(r"[A-Za-z0-9_.-]+", s)[0].lower().replace("_", "-") for s in specs}


def undeclared(sources: dict[str, str]) -> list[str]:
    have = declared()
    return sorted(
        f"{where}: {top}"
        for top, where in imported_packages(sources).items()
        if DISTRIBUTION.get(top, top).lower().replace("_", "-") not in have
    )


def test_every_imported_package_is_declared() -> None:
    files = [*ROOT.joinpath("ae").rglob("*.py"), *ROOT.joinpath("logging_cfg").rglob("*.py")]
    sources = {str(f.relative_to(ROOT)): f.read_text() for f in files}
    assert undeclared(sources) == []
    # The check sees what it is for: an import of a package pyproject.toml does not name.
    injected = {"ae/x.py": "import json\nfrom PIL import Image\nimport not_declared.sub\n"}
    assert undeclared(injected) == ["ae/x.py:3: not_declared"]
