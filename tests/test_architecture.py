"""The package layout is the architecture: imports go one way, and the launcher stays light.

Layers, lowest first (a module may import its own package and any lower layer, never a higher one):
    logging_cfg  <-  ae core (config, errors, log_lines, run_paths, atomic_files)  <-  ae.forensics
    <-  ae.data  <-  ae.training | ae.job  <-  ae.rank  <-  ae.cli
ae.data in its own layers: shards  <-  decoding | planning  <-  stream  <-  the data module (the
modules in ae/data itself)  <-  tools (the ae-shards commands).
`ae.diagnose` sits on the core alone (torch-free: it reads the logs of dead runs anywhere).
`ae.job`, the launcher, sits beside `ae.training` and never imports it, torch or Lightning: it
answers bad flags in a second and starts the ranks, which do the training (`ae.rank`).

The layers and the import graph: tests/import_layers.py. Other libraries through their public
API only: tests/test_architecture_public_api.py.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.import_layers import (
    LAYERS,
    cycles,
    import_graph,
    layer_violations,
    package_graph,
    package_of,
    parse,
    top_level_statements,
)
from tests.support.runs import ROOT

# Whatever ae.job imports, directly or through other modules, never loads these.
HEAVY = ("torch", "lightning")


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
    # apply), atomic_files (the one write-to-temp-then-rename of every layer) and process_end
    # (children that die with their parent; ranks that exit without the interpreter's teardown)
    assert len(entries) <= 15, sorted(p.name for p in entries)


MAX_MODULE_LINES = 400  # past it, a module holds more than one concern: split it by concern


def test_no_module_is_over_400_lines() -> None:
    modules = [ROOT / "train_ae.py"]
    for folder in ("ae", "logging_cfg", "bench", "tests"):
        modules += ROOT.joinpath(folder).rglob("*.py")
    assert len(modules) > 300, len(modules)  # the tree was found
    long = {str(p.relative_to(ROOT)): n for p in modules
            if (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES}  # fmt: skip
    assert long == {}, long


def module_path(module: str) -> Path:
    path = ROOT.joinpath(*module.split("."))
    return path.with_suffix(".py") if path.with_suffix(".py").is_file() else path / "__init__.py"


def heavy_at_import(module: str) -> list[str]:
    """torch / Lightning, where a module imports them at import time."""
    found = set()
    for node in top_level_statements(parse(module_path(module))):
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


# One fresh interpreter imports the modules one after another and lists, after each, the torch
# and Lightning modules loaded so far. A module that loads one shows it after its own import: the
# modules before it loaded none (no heavy module is ever imported and then forgotten). One
# interpreter for all, not one each: ~20 interpreters were ~5 s of CPU.
HEAVY_SCRIPT = """
import json, sys
found = {}
for module in sys.argv[1:]:
    __import__(module)
    assert module in sys.modules, module  # the measurement itself works
    found[module] = sorted(m for m in sys.modules if m.split(".")[0] in HEAVY)
print(json.dumps(found))
""".replace("HEAVY", repr(HEAVY))


def heavy_imports(modules: list[str]) -> dict[str, list[str]]:
    """Module -> the torch and Lightning modules loaded once it and the modules before it in
    `modules` are imported, in a fresh interpreter."""
    out = subprocess.run(
        [sys.executable, "-c", HEAVY_SCRIPT, *modules],
        cwd=ROOT, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    found = json.loads(out.stdout)
    assert list(found) == modules  # every module was imported
    return found


def test_launcher_and_diagnose_do_not_import_torch() -> None:
    """--help and bad flags answer in well under a second: no torch, no Lightning; ae-shards
    too, until it reads a shard. Every module of ae.job, and the entry points over it."""
    jobs = sorted(m for m in import_graph() if package_of(m) == "ae.job")
    assert "ae.job.launch" in jobs
    entries = ("ae.cli.launch", "ae.cli.encode", "ae.diagnose.cli", "ae.cli.shards")
    for module, heavy in heavy_imports([*entries, *jobs]).items():
        assert heavy == [], f"{module} imports {heavy[:5]}"


@pytest.mark.parametrize(
    ("rank", "needs"),
    [("ae.rank.train", {"ae.job.preflight", "ae.job.rank_env"}),
     ("ae.rank.encode", {"ae.job.encode_args"}), ("ae.cli.encode_rank", {"ae.job.encode_args"})],
)  # fmt: skip
def test_a_rank_imports_neither_the_launcher_nor_diagnose(rank: str, needs: set[str]) -> None:
    """A rank imports what it runs: ~0.15 s of CPU a training rank went to the launcher and
    ae-diagnose for three names of the environment (ae.job.rank_env holds them), ~0.2 s an
    ae-encode rank for its arguments' parser (ae.job.encode_args holds it)."""
    graph = import_graph(at_import=True)
    seen, todo = set(), [rank]
    while todo:
        for dep in graph[todo.pop()] - seen:
            seen.add(dep)
            todo.append(dep)
    assert needs <= seen  # the walk itself works
    # The folder lock (ae-encode's arguments check OUT_DIR is no training run's) reads the
    # heartbeat files: that reader alone of ae-diagnose, one small module.
    launchers, reader = ("ae.job.launch", "ae.job.encode"), "ae.diagnose.heartbeats"
    extra = sorted(
        m for m in seen if (package_of(m) == "ae.diagnose" and m != reader) or m in launchers
    )
    assert extra == [], f"{rank} imports {extra[:5]}"


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
