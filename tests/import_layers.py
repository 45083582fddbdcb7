"""The layers of the package layout and the project's import graph, read from the source (AST)
without importing it: which package may import which (tests/test_architecture.py states the
rule), each module's package, the imports that break the rule, and import cycles."""

from __future__ import annotations

import ast
import functools
from pathlib import Path

from tests.support.runs import ROOT

LAYERS = {
    "logging_cfg": 0,
    "ae": 1,  # the core modules directly in ae/
    "ae.forensics": 2,
    "ae.diagnose": 2,
    "ae.data.shards": 3,  # tar reading, writing and counting; shard specs and index sidecars
    "ae.data.decoding": 4,  # sample bytes -> arrays
    "ae.data.planning": 4,  # counts and the even split (beside decoding: neither imports the other)
    "ae.data.stream": 5,  # the per-rank stream of batches, its loaders and resume
    "ae.data": 6,  # the data module over them (the modules in ae/data itself)
    "ae.data.tools": 7,  # the ae-shards commands
    "ae.training": 8,
    "ae.job": 8,  # beside training, not above it: the launcher never imports training
    "ae.rank": 9,
    "ae.cli": 10,
}
DATA = [pkg for pkg in LAYERS if pkg.split(".")[:2] == ["ae", "data"]]
# What each package may import besides itself: its layer's lower layers, except that diagnose
# sees only the core (and nothing imports diagnose but the command line and the launcher, which
# reads a failed run's logs to say how it ended).
ALLOWED = {
    pkg: {other for other, lvl in LAYERS.items() if lvl < level} for pkg, level in LAYERS.items()
}
ALLOWED["ae.diagnose"] = {"logging_cfg", "ae"}
for pkg in (*DATA, "ae.training", "ae.rank"):
    ALLOWED[pkg].discard("ae.diagnose")


def package_of(module: str) -> str:
    """The longest package of LAYERS that holds `module`: `ae.data.stream.stages` ->
    `ae.data.stream`; `ae.data.datamodule` -> `ae.data`; `ae.config` -> `ae`;
    `logging_cfg.sinks` -> `logging_cfg`."""
    if module.split(".")[0] == "logging_cfg":
        return "logging_cfg"
    parts = module.split(".")
    for n in range(len(parts), 1, -1):
        if (prefix := ".".join(parts[:n])) in LAYERS:
            return prefix
    return "ae"


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


@functools.cache
def parse(path: Path) -> ast.Module:
    """A source file's tree, parsed once per test process: the architecture tests walk the same
    ~150 files many times over (the job rule once per module it follows), and parsing them again
    each time was most of their CPU. The tree is only read, never changed."""
    return ast.parse(path.read_text())


def import_graph(at_import: bool = False) -> dict[str, set[str]]:
    """Module -> the project modules it imports (any import statement, lazy ones included; with
    `at_import`, only those that run when the module is imported). A new dict each call: tests
    add edges to it."""
    files = [*ROOT.joinpath("ae").rglob("*.py"), *ROOT.joinpath("logging_cfg").rglob("*.py")]
    names = {module_name(f) for f in files}
    graph: dict[str, set[str]] = {}
    for f in files:
        mod = module_name(f)
        deps: set[str] = set()
        tree = parse(f)
        for node in top_level_statements(tree) if at_import else ast.walk(tree):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                base = node.module
                targets = [base, *(f"{base}.{a.name}" for a in node.names)]
            for t in targets:
                # the longest project module that the target names
                while t and t not in names:
                    t = t.rpartition(".")[0]
                if t and t != mod:
                    deps.add(t)
        graph[mod] = deps
    return graph


def layer_violations(graph: dict[str, set[str]]) -> list[str]:
    out = []
    for mod, deps in graph.items():
        pkg = package_of(mod)
        for dep in deps:
            dep_pkg = package_of(dep)
            if dep_pkg != pkg and dep_pkg not in ALLOWED[pkg]:
                out.append(f"{mod} -> {dep} ({pkg} may not import {dep_pkg})")
    return sorted(out)


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def package_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    out: dict[str, set[str]] = {}
    for mod, deps in graph.items():
        pkg = package_of(mod)
        out.setdefault(pkg, set()).update(package_of(d) for d in deps if package_of(d) != pkg)
    return out


def top_level_statements(tree: ast.Module) -> list[ast.stmt]:
    """What runs when a module is imported: its statements, also inside top-level if/try/with
    blocks, but not in function bodies (a lazy import runs when the function is called) nor
    under `if TYPE_CHECKING:`."""
    out: list[ast.stmt] = []
    body = list(tree.body)
    while body:
        node = body.pop()
        out.append(node)
        if isinstance(node, ast.If) and ast.unparse(node.test) == "TYPE_CHECKING":
            body += node.orelse
        elif isinstance(node, ast.If | ast.Try | ast.With):
            body += node.body + getattr(node, "orelse", []) + getattr(node, "finalbody", [])
            for handler in getattr(node, "handlers", []):
                body += handler.body
    return out
