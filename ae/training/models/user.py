"""Your own model, `--model=package.module:ClassName` with `--model_args` as its keyword arguments.

The class is either
- an `nn.Module` with `encode(x) -> z` and `decode(z) -> x_hat` (and optionally
  `loss(x) -> (loss, {name: tensor})`, else `--loss` on `decode(encode(x))`), which `ae` wraps in
  its own LightningModule (optimizer, LR schedule, metrics, EMA, grids), or
- a `LightningModule`, trained as it is: its own steps, logging and optimizers (give it
  `encode`/`decode` too for grids and `ae-encode`).
A constructor that takes an `input_shape` argument gets the shape of one sample, (D,) or (C, H, W),
unless `--model_args` sets it.

Two checks, so that a mistake is one message: `locate_class` runs in the launcher, before any
worker starts, without importing anything (it finds the module's file the way the import system
would, and reads its source for the name); `load_class`/`build` run in each rank before training
and turn any import or constructor failure into a `ModelError`. This module imports no torch at
import time: the launcher uses it.
"""

from __future__ import annotations

import ast
import importlib
import importlib.machinery
import inspect
import os
import sys
from pathlib import Path
from typing import Any

from ae.training.models import ModelError


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
        return f"model: {found} defines no {name!r}"
    return None


def load_class(path: str) -> type:
    """Import `package.module` (from the working directory or PYTHONPATH) and return its class."""
    module, name = split_path(path)
    if os.getcwd() not in sys.path:  # `python train_ae.py` puts the script's folder there only
        sys.path.insert(0, os.getcwd())
    try:
        mod = importlib.import_module(module)
    except Exception as e:  # the user's module may fail in any way while it runs
        raise ModelError(f"model: cannot import {module}: {type(e).__name__}: {e}") from e
    cls = getattr(mod, name, None)
    if not isinstance(cls, type):
        what = "no such name" if cls is None else f"a {type(cls).__name__}, not a class"
        raise ModelError(f"model: {path}: {what}")
    return cls


def build(cls: type, model_args: dict[str, Any] | None, input_shape: tuple[int, ...]) -> Any:
    """`cls(**model_args)` (plus `input_shape` when the constructor takes it), checked to be an
    nn.Module with encode/decode or a LightningModule."""
    import lightning as L  # here: the launcher imports this module and must not load torch
    from torch import nn

    kwargs = dict(model_args or {})
    try:
        params = inspect.signature(cls).parameters
    except (TypeError, ValueError):
        params = {}
    if "input_shape" in params and "input_shape" not in kwargs:
        kwargs["input_shape"] = tuple(input_shape)
    shown = f"{cls.__module__}:{cls.__qualname__}"
    try:
        obj = cls(**kwargs)
    except Exception as e:  # a user constructor may fail in any way
        raise ModelError(
            f"model: {shown}(**model_args) with model_args {model_args or {}} failed: "
            f"{type(e).__name__}: {e}"
        ) from e
    if isinstance(obj, L.LightningModule):
        return obj
    missing = [m for m in ("encode", "decode") if not callable(getattr(obj, m, None))]
    if not isinstance(obj, nn.Module) or missing:
        raise ModelError(
            f"model: {shown} must be a LightningModule, or an nn.Module with encode(x) and "
            f"decode(z); it is a {type(obj).__name__}"
            + (f" without {' and '.join(missing)}" if missing else "")
        )
    return obj
