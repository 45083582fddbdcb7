"""The package layout is the architecture: imports go one way, and the launcher stays light.

Layers, lowest first (a module may import its own package and any lower layer, never a higher one):
    logging_cfg  <-  ae core (config, errors, log_lines, run_paths, atomic_files)  <-  ae.forensics
    <-  ae.data  <-  ae.training | ae.job  <-  ae.rank  <-  ae.cli
ae.data in its own layers: shards  <-  decoding | planning  <-  stream  <-  the data module (the
modules in ae/data itself)  <-  tools (the ae-shards commands).
`ae.diagnose` sits on the core alone (torch-free: it reads the logs of dead runs anywhere).
`ae.job`, the launcher, sits beside `ae.training` and never imports it, torch or Lightning: it
answers bad flags in a second and starts the ranks, which do the training (`ae.rank`).
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
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
# Whatever ae.job imports, directly or through other modules, never loads these.
HEAVY = ("torch", "lightning")


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


def import_graph(at_import: bool = False) -> dict[str, set[str]]:
    """Module -> the project modules it imports (any import statement, lazy ones included; with
    `at_import`, only those that run when the module is imported)."""
    files = [*ROOT.joinpath("ae").rglob("*.py"), *ROOT.joinpath("logging_cfg").rglob("*.py")]
    names = {module_name(f) for f in files}
    graph: dict[str, set[str]] = {}
    for f in files:
        mod = module_name(f)
        deps: set[str] = set()
        tree = ast.parse(f.read_text())
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


def test_every_package_has_a_layer() -> None:
    assert {package_of(m) for m in import_graph()} == set(LAYERS)


def test_imports_go_one_way_without_cycles() -> None:
    graph = import_graph()
    assert layer_violations(graph) == []
    assert cycles(graph) == []
    assert cycles(package_graph(graph)) == []


def test_the_checks_catch_an_injected_back_edge() -> None:
    graph = import_graph()
    stream = "ae.data.stream.shard_stream"
    graph[stream] = graph[stream] | {"ae.training.model"}
    assert layer_violations(graph) == [
        f"{stream} -> ae.training.model (ae.data.stream may not import ae.training)"
    ]
    # training imports the data module, which imports the stream: one loop through the three
    assert ["ae.data", "ae.data.stream", "ae.training"] in cycles(package_graph(graph))
    # between the data sub-packages: upward (shards reading a plan) and sideways (planning
    # decoding samples) both break the rule
    graph = import_graph()
    for mod, dep in (
        ("ae.data.shards.tar_samples", "ae.data.planning.plan"),
        ("ae.data.planning.counts", "ae.data.decoding.decode"),
    ):
        graph[mod] = graph[mod] | {dep}
    assert layer_violations(graph) == [
        "ae.data.planning.counts -> ae.data.decoding.decode"
        " (ae.data.planning may not import ae.data.decoding)",
        "ae.data.shards.tar_samples -> ae.data.planning.plan"
        " (ae.data.shards may not import ae.data.planning)",
    ]
    # a module cycle inside one package, which no layer rule sees
    graph = import_graph()
    spec, demo = "ae.data.shards.spec", "ae.data.shards.demo"
    graph[spec] = graph[spec] | {demo}
    assert any(spec in c and demo in c for c in cycles(graph))


def test_top_level_of_ae_stays_small() -> None:
    entries = [p for p in ROOT.joinpath("ae").iterdir() if p.name != "__pycache__"]
    # 7 packages and 8 modules: the core holds what forensics and diagnose share (config, errors,
    # log_lines, run_paths, stragglers: the straggler rules both the detector and ae-diagnose
    # apply), atomic_files (the one write-to-temp-then-rename of every layer) and parent_death
    # (torchrun's wrapper and the dataloader workers: children that die with their parent)
    assert len(entries) <= 15, sorted(p.name for p in entries)


def module_path(module: str) -> Path:
    path = ROOT.joinpath(*module.split("."))
    return path.with_suffix(".py") if path.with_suffix(".py").is_file() else path / "__init__.py"


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


def heavy_at_import(module: str) -> list[str]:
    """torch / Lightning, where a module imports them at import time."""
    found = set()
    for node in top_level_statements(ast.parse(module_path(module).read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found.add(node.module.split(".")[0])
    return sorted(found & set(HEAVY))


def job_violations(graph: dict[str, set[str]], at_import: dict[str, set[str]]) -> list[str]:
    """ae.job's rule: no import of ae.training anywhere in it (lazy imports included), and no
    module that importing one of its modules loads (`at_import`, followed through the project)
    imports torch or Lightning."""
    out = [
        f"{mod} -> {dep} (ae.job may not import ae.training)"
        for mod, deps in graph.items()
        if package_of(mod) == "ae.job"
        for dep in deps
        if package_of(dep) == "ae.training"
    ]
    for start in sorted(m for m in at_import if package_of(m) == "ae.job"):
        seen, todo = {start}, [start]
        while todo:
            mod = todo.pop()
            if heavy := heavy_at_import(mod):
                out.append(f"{start} loads {mod}, which imports {', '.join(heavy)}")
            todo += [d for d in at_import.get(mod, ()) if d not in seen]
            seen.update(at_import.get(mod, ()))
    return sorted(out)


def test_the_job_package_imports_neither_training_nor_torch() -> None:
    assert job_violations(import_graph(), import_graph(at_import=True)) == []


def test_the_job_rule_catches_an_injected_import_of_training() -> None:
    graph, at_import = import_graph(), import_graph(at_import=True)
    edge = "ae.job.launch -> ae.training.models.user (ae.job may not import ae.training)"
    for g in (graph, at_import):
        g["ae.job.launch"] = g["ae.job.launch"] | {"ae.training.models.user"}
    found = job_violations(graph, at_import)
    assert edge in found
    # and what importing the launcher would then load: torch, through the training package
    assert "ae.job.launch loads ae.training.models.user, which imports lightning, torch" in found
    assert edge in layer_violations(graph)  # training is no layer below the launcher
    # a lazy import (inside a function) breaks the first rule only
    graph, at_import = import_graph(), import_graph(at_import=True)
    graph["ae.job.topology"] = graph["ae.job.topology"] | {"ae.training.model"}
    assert job_violations(graph, at_import) == [
        "ae.job.topology -> ae.training.model (ae.job may not import ae.training)"
    ]


def heavy_imports(module: str) -> list[str]:
    """torch and Lightning modules that `import module` loads in a fresh interpreter (measured
    the way `python -X importtime` lists them)."""
    out = subprocess.run(
        [sys.executable, "-X", "importtime", "-c", f"import {module}"],
        cwd=ROOT, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    imported = {line.rsplit("|", 1)[-1].strip() for line in out.stderr.splitlines()}
    assert module in imported  # the measurement itself works
    return sorted(m for m in imported if m.split(".")[0] in HEAVY)


def test_launcher_and_diagnose_do_not_import_torch() -> None:
    """--help and bad flags answer in well under a second: no torch, no Lightning; ae-shards
    too, until it reads a shard. Every module of ae.job, and the entry points over it."""
    jobs = sorted(m for m in import_graph() if package_of(m) == "ae.job")
    assert "ae.job.launch" in jobs
    entries = ("ae.cli.launch", "ae.cli.encode", "ae.diagnose.cli", "ae.cli.shards")
    for module in (*entries, *jobs):
        heavy = heavy_imports(module)
        assert heavy == [], f"{module} imports {heavy[:5]}"


def test_no_work_at_import_time() -> None:
    """Importing every module installs no signal handler, atexit hook or warnings filter, and
    reads no AE_FAULT (a malformed one must not break an import)."""
    script = (
        "import atexit, pkgutil, signal, warnings, importlib, os\n"
        "os.environ['AE_FAULT'] = 'not-a-fault'\n"
        # the libraries' own import-time registrations are not ours
        "import torch, lightning.pytorch, lightning.pytorch.loggers, webdataset\n"
        "import loguru, PIL.Image\n"
        "filters, term = list(warnings.filters), signal.getsignal(signal.SIGTERM)\n"
        "n_exit = atexit._ncallbacks()\n"
        "import ae, logging_cfg\n"
        "for pkg in (ae, logging_cfg):\n"
        "    for m in pkgutil.walk_packages(pkg.__path__, pkg.__name__ + '.'):\n"
        "        if not m.name.endswith('__main__'):\n"
        "            importlib.import_module(m.name)\n"
        "assert warnings.filters == filters, 'warnings filter installed at import'\n"
        "assert signal.getsignal(signal.SIGTERM) == term, 'signal handler installed at import'\n"
        "assert atexit._ncallbacks() == n_exit, 'atexit hook registered at import'\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr[-2000:]


# Other libraries' private names that ae may use, each with why. Private attributes of torch,
# Lightning or webdataset change without notice between releases (ae once had to pin
# `lightning<2.7` for one), so there are none here.
PRIVATE_ALLOWED = {
    # The stall report's stacks of every thread: documented in the Python library reference,
    # with no public equivalent (`faulthandler` writes to a file descriptor, not to a string).
    "_current_frames",
    # A rank past --hang_timeout leaves from its watchdog thread while the main thread is stuck:
    # `os._exit` is the documented way to end a process from another thread (`sys.exit` there
    # ends only that thread).
    "_exit",
}
# Private names allowed in one module only. The Flight Recorder's dump (issue 24): torch 2.13 has
# no public function for it (torch.distributed.debug serves it over HTTP, with extra packages).
PRIVATE_ALLOWED_IN = {
    "ae/forensics/flight_recorder.py": {
        "_C", "_distributed_c10d", "_dump_fr_trace", "_dump_nccl_trace",
    },
    # AE_FAULT=gpusleep (issue 40): a kernel that spins on the GPU, a hung kernel on demand.
    # torch's own tests use torch.cuda._sleep for this; there is no public equivalent.
    "ae/forensics/faults.py": {"_sleep"},
    # --max_restarts on several nodes (issue 38): torchrun's elastic agent has no public hook
    # between a rendezvous and its workers' start, where every node must take the attempt's run
    # TS, RESTART line and arguments; ae.job.elastic wraps the agent's own step there. Whether
    # this node's workers failed, or were stopped to take in a node that joined, only the
    # agent's count of restarts left tells (torchrun spends one on a failure alone).
    "ae/job/elastic.py": {"_start_workers", "_remaining_restarts"},
}  # fmt: skip
# What issue 22 removed, named: a grep finds them in comments and strings too.
REMOVED_PRIVATE = re.compile(
    r"\._should_check_val_fx|_should_accumulate|_average_model|\._iterator"
)


def _is_private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _is_project(module: str | None) -> bool:
    return module is not None and module.split(".")[0] in ("ae", "logging_cfg")


def _class_attrs(cls: ast.ClassDef) -> set[str]:
    """The names a class defines: its methods and class-level names, and what its methods set
    on `self`/`cls`."""
    attrs: set[str] = set()
    for stmt in cls.body:
        if isinstance(stmt, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            attrs.add(stmt.name)
        elif isinstance(stmt, ast.Assign | ast.AnnAssign):
            targets = stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target]
            attrs.update(t.id for t in targets if isinstance(t, ast.Name))
    for node in ast.walk(cls):
        if (
            isinstance(node, ast.Attribute)
            and isinstance(node.ctx, ast.Store)
            and isinstance(node.value, ast.Name)
            and node.value.id in ("self", "cls")
        ):
            attrs.add(node.attr)
    return attrs


def _base_names(cls: ast.ClassDef) -> list[str]:
    return [b.id if isinstance(b, ast.Name) else b.attr for b in cls.bases
            if isinstance(b, ast.Name | ast.Attribute)]  # fmt: skip


def _type_names(annotation: ast.expr | None) -> set[str]:
    """The class names an annotation names (`A`, `"A"`, `A | None`, `m.A`)."""
    if annotation is None:
        return set()
    if isinstance(annotation, ast.Constant) and isinstance(annotation.value, str):
        try:
            annotation = ast.parse(annotation.value, mode="eval").body
        except SyntaxError:
            return set()
    return {
        n.id if isinstance(n, ast.Name) else n.attr
        for n in ast.walk(annotation)
        if isinstance(n, ast.Name | ast.Attribute)
    }


def _typed_names(node: ast.AST, cls: ast.ClassDef | None) -> list[tuple[str, set[str]]]:
    """The names a statement gives a class: `x: A`, `x = A(...)` (`cls(...)` in a class),
    `isinstance(x, A)`."""
    if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
        return [(node.target.id, _type_names(node.annotation))]
    if isinstance(node, ast.Assign) and isinstance(node.value, ast.Call):
        func = node.value.func
        made = {cls.name} if cls and isinstance(func, ast.Name) and func.id == "cls" else set()
        made |= {func.id} if isinstance(func, ast.Name) and func.id != "cls" else set()
        return [(t.id, made) for t in node.targets if isinstance(t, ast.Name)]
    if (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Name)
        and node.func.id == "isinstance"
        and len(node.args) == 2
        and isinstance(node.args[0], ast.Name)
    ):
        return [(node.args[0].id, _type_names(node.args[1]))]
    return []


class _Owners:
    """Which private names an object's known type has: the project's classes by name, with the
    names of their project base classes."""

    def __init__(self, trees: dict[str, ast.Module]) -> None:
        self.classes: dict[str, tuple[set[str], list[str]]] = {}
        for tree in trees.values():
            for node in ast.walk(tree):
                if isinstance(node, ast.ClassDef):
                    attrs, bases = self.classes.get(node.name, (set(), []))
                    self.classes[node.name] = (
                        attrs | _class_attrs(node),
                        bases + _base_names(node),
                    )

    def has(self, cls: str, name: str, seen: frozenset[str] = frozenset()) -> bool:
        if cls not in self.classes or cls in seen:
            return False
        attrs, bases = self.classes[cls]
        return name in attrs or any(self.has(b, name, seen | {cls}) for b in bases)


def _scopes(tree: ast.Module) -> dict[ast.AST, tuple[ast.ClassDef | None, dict[str, set[str]]]]:
    """For each node: its innermost class, and the annotated types of the names in scope (the
    function's annotated arguments and variables)."""
    out: dict[ast.AST, tuple[ast.ClassDef | None, dict[str, set[str]]]] = {}

    def visit(node: ast.AST, cls: ast.ClassDef | None, types: dict[str, set[str]]) -> None:
        if isinstance(node, ast.ClassDef):
            cls = node
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
            types = dict(types)
            a = node.args
            for arg in [*a.posonlyargs, *a.args, *a.kwonlyargs, a.vararg, a.kwarg]:
                if arg is not None and arg.arg not in ("self", "cls"):
                    types[arg.arg] = _type_names(arg.annotation)
            if not isinstance(node, ast.Lambda):
                for sub in ast.walk(node):
                    for name, named in _typed_names(sub, cls):
                        types[name] = types.get(name, set()) | named
        out[node] = (cls, types)
        for child in ast.iter_child_nodes(node):
            visit(child, cls, types)

    visit(tree, None, {})
    return out


def _known(
    obj: ast.expr, name: str, at: ast.AST, scopes: dict, modules: set[str], owners: _Owners
) -> bool:
    """Whether `obj` is an object whose class (or module) is the project's and has `name`."""
    cls, types = scopes[at]
    if isinstance(obj, ast.Call) and isinstance(obj.func, ast.Name) and obj.func.id == "super":
        return cls is not None and any(owners.has(b, name) for b in _base_names(cls))
    if not isinstance(obj, ast.Name):
        return False
    if obj.id in ("self", "cls"):
        return cls is not None and owners.has(cls.name, name)
    if obj.id in types:
        return any(owners.has(t, name) for t in types[obj.id])
    return obj.id in modules or owners.has(obj.id, name)


def private_access(sources: dict[str, str]) -> list[str]:
    """`file:line: code` for each use of a private name (`_x`, not `__x__`) on an object ae did
    not define: `obj._x` and `getattr(obj, "_x")` (and set/has/delattr) pass only where `obj`
    is `self`/`cls` (or `super()`) in a class of the project that has `_x` (itself or a project
    base class), an argument or variable annotated with such a class, such a class, or a module
    of the project; `from lib import _x` and `import lib._x` pass only for the project's own
    modules. That ae has a `_step` of its own does not make `trainer._step` its own."""
    trees = {path: ast.parse(text) for path, text in sources.items()}
    owners = _Owners(trees)
    found = []
    for path, tree in trees.items():
        allowed = PRIVATE_ALLOWED | PRIVATE_ALLOWED_IN.get(path, set())
        scopes = _scopes(tree)
        modules = {  # names bound to the project's modules in this file
            a.asname or a.name.split(".")[0]
            for node in ast.walk(tree)
            for a in getattr(node, "names", [])
            if (isinstance(node, ast.Import) and _is_project(a.name))
            or (isinstance(node, ast.ImportFrom) and _is_project(node.module) and a.name.islower())
        }

        for node in ast.walk(tree):
            uses: list[tuple[str, bool]] = []  # (private name, on an object ae defined)
            if isinstance(node, ast.Attribute):
                uses = [(node.attr, _known(node.value, node.attr, node, scopes, modules, owners))]
            elif (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Name)
                and node.func.id in ("getattr", "setattr", "hasattr", "delattr")
                and len(node.args) > 1
                and isinstance(node.args[1], ast.Constant)
                and isinstance(node.args[1].value, str)
            ):
                name = node.args[1].value
                uses = [(name, _known(node.args[0], name, node, scopes, modules, owners))]
            elif isinstance(node, ast.ImportFrom) and not (node.level or _is_project(node.module)):
                uses = [(n, False) for n in [*(node.module or "").split("."),
                                             *(a.name for a in node.names)]]  # fmt: skip
            elif isinstance(node, ast.Import):
                libraries = [a.name for a in node.names if not _is_project(a.name)]
                uses = [(part, False) for name in libraries for part in name.split(".")]
            if any(_is_private(n) and not ok and n not in allowed for n, ok in uses):
                found.append(f"{path}:{node.lineno}: {ast.unparse(node)[:100]}")
    return found


def test_no_private_attribute_of_a_library() -> None:
    """ae and logging_cfg use torch, Lightning and webdataset through their public API only, so
    that ae installs next to any newer release (no upper bound in pyproject.toml)."""
    files = [*ROOT.joinpath("ae").rglob("*.py"), *ROOT.joinpath("logging_cfg").rglob("*.py")]
    sources = {str(f.relative_to(ROOT)): f.read_text() for f in files}
    assert private_access(sources) == []
    named = [
        f"{path}:{n}: {line.strip()}"
        for path, text in sources.items()
        for n, line in enumerate(text.splitlines(), 1)
        if REMOVED_PRIVATE.search(line)
    ]
    assert named == []
    # The check catches each kind of use, and leaves the project's own private names alone.
    injected = {
        "ae/x.py": "from torch.utils.data import _utils\nimport torch._dynamo\n"
        "def f(loader, loop, trainer):\n"
        "    loop._should_check_val_fx = None\n"
        "    return loader._iterator, getattr(trainer, '_logger_connector')\n",
        "ae/y.py": "from ae.x import _helper\nclass A:\n"
        "    def __init__(self):\n        self._own = 1\n"
        "    def g(self, other: A):\n        return other._own, _helper, self.__class__\n",
    }
    found = private_access(injected)
    assert [f.split(":")[1] for f in found] == ["1", "2", "4", "5", "5"], found
    assert all(f.startswith("ae/x.py:") for f in found)


def test_a_private_name_ae_defines_elsewhere_is_not_ae_s_on_a_library_object() -> None:
    """ae has a `_step` of its own (here `Loop._step`): that does not make a Lightning trainer's
    `_step` ae's. Only an object whose class ae wrote (self, a typed argument, one it built)
    may be reached into; an untyped argument is anyone's."""
    sources = {
        "ae/loop.py": "class Loop:\n"
        "    def _step(self):\n        return self._count\n"
        "    def run(self, other: Loop, trainer):\n"
        "        self._count = 0\n"
        "        made = Loop()\n"
        "        return self._step(), other._step(), made._step(), trainer._step()\n"
        "def hook(trainer, module):\n"
        "    trainer._step()\n"
        "    if isinstance(module, Loop):\n        module._count += 1\n"
        "    return getattr(module, '_count'), module._other\n",
    }
    found = sorted(private_access(sources))
    assert found == [
        "ae/loop.py:12: module._other",
        "ae/loop.py:7: trainer._step",
        "ae/loop.py:9: trainer._step",
    ], found
