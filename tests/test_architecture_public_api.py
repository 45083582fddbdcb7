"""ae and logging_cfg reach torch, Lightning and webdataset through their public API only: no
private name (`_x`) of a library, but for the few allowed here, each with why; the project's
own private names stay free. Read from the source (AST)."""

from __future__ import annotations

import ast
import re

from tests.support.runs import ROOT

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
    # Under SLURM a requeue or scancel signals torchrun itself besides the launcher's SIGTERM:
    # the second signal raised inside the agent's shutdown of the ranks, and torchrun died with
    # them unsaved. The agent installs its handler by this module-level name, with no public
    # hook around it; ae.job.torchrun wraps it to act on the first stop signal alone.
    "ae/job/torchrun.py": {"_terminate_process_handler"},
    # Not a library's: CPython's own exit step (Py_FinalizeEx calls it; there since Python 2).
    # A rank that skips the interpreter's teardown (~1.2 s of CPU) still runs its atexit
    # handlers -- loguru's sinks, multiprocessing's workers, a W&B run -- and no public name
    # runs them before `os._exit`.
    "ae/process_end.py": {"_run_exitfuncs"},
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
