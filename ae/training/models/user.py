"""Your own model, `--model=package.module:ClassName` with `--model_args` as its keyword arguments.

The class is either
- an `nn.Module` with `encode(x) -> z` and `decode(z) -> x_hat` (and optionally `loss(x) ->
  loss` or `(loss, {name: tensor})`, else `--loss` on `decode(encode(x))`), which `ae` wraps in
  its own LightningModule (optimizer, LR schedule, metrics, EMA, grids), or
- a `LightningModule`, trained as it is: its own steps, logging and optimizers (give it
  `encode`/`decode` too for grids and `ae-encode`).
A constructor that takes an `input_shape` argument gets the shape of one sample, (D,) or (C, H, W),
unless `--model_args` sets it.

Two checks, so that a mistake is one message: `ae.config.model_path.locate_class` runs in the
launcher, before any worker starts, without importing anything; `load_class`/`build` (here) run in
each rank before training and turn any import or constructor failure into a `ModelError`.
"""

from __future__ import annotations

import difflib
import importlib
import inspect
import os
import sys
import sysconfig
import traceback
from pathlib import Path
from typing import Any

import lightning as L
from torch import nn

from ae.config.model_path import split_path
from ae.training.models import ModelError

# Files that are not the user's: the standard library, installed packages (torch, Lightning,
# diffusers), ae itself. The innermost frame of a traceback outside them is where a user's
# module, constructor or network failed.
_NOT_USERS = tuple(
    {sysconfig.get_paths()[k] for k in ("stdlib", "platstdlib", "purelib", "platlib")}
    | {str(Path(__file__).resolve().parents[2])}  # ae/
)


def _users(filename: str) -> bool:
    if filename.startswith("<"):  # <frozen importlib._bootstrap>, <string>
        return False
    path = str(Path(filename).resolve())
    if "site-packages" in path or "dist-packages" in path:
        return False
    return not any(path == d or path.startswith(d + os.sep) for d in _NOT_USERS)


def where_raised(e: BaseException) -> str:
    """` (at my_model.py:12, in encode)`: the innermost line of the user's own code in `e`'s
    traceback (a SyntaxError: its file and line), relative to the working directory when under
    it; "" when none is the user's. The message then names the line to fix; the whole traceback
    is in the rank's debug log (`ae.rank.exit`)."""
    if isinstance(e, SyntaxError) and e.filename and e.lineno:
        where = (e.filename, e.lineno, None)
    else:
        frames = [f for f in traceback.extract_tb(e.__traceback__) if _users(f.filename)]
        if not frames:
            return ""
        where = (frames[-1].filename, frames[-1].lineno, frames[-1].name)
    filename, line, func = where
    try:
        shown = str(Path(filename).resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        shown = filename
    return f" (at {shown}:{line}" + (f", in {func})" if func and func != "<module>" else ")")


def first_line(e: BaseException) -> str:
    """`RuntimeError: mat1 and mat2 shapes cannot be multiplied (at net.py:9, in encode)`."""
    return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}{where_raised(e)}"


def load_class(path: str) -> type:
    """Import `package.module` (from the working directory or PYTHONPATH) and return its class."""
    module, name = split_path(path)
    if os.getcwd() not in sys.path:  # `python train_ae.py` puts the script's folder there only
        sys.path.insert(0, os.getcwd())
    try:
        mod = importlib.import_module(module)
    except Exception as e:  # the user's module may fail in any way while it runs
        raise ModelError(f"model: cannot import {module}: {first_line(e)}") from e
    cls = getattr(mod, name, None)
    if not isinstance(cls, type):
        what = "no such name" if cls is None else f"a {type(cls).__name__}, not a class"
        raise ModelError(f"model: {path}: {what}")
    return cls


def _args_hint(params: Any, given: dict[str, Any]) -> str:
    """The constructor's required arguments that `--model_args` did not give, as the flag that
    gives them with those it gave (the values left to the user: `...`), or ""."""
    named = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    takes = [name for name, p in params.items() if p.kind in named]
    open_ended = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    unknown = [k for k in given if k not in takes]
    if unknown and takes and not open_ended:  # a misspelt argument
        near = difflib.get_close_matches(unknown[0], takes, n=1)
        guess = f" (did you mean {near[0]}?)" if near else ""
        return f"; it takes {', '.join(takes)}{guess}"
    needed = [
        name for name, p in params.items()
        if p.default is inspect.Parameter.empty and name not in given and p.kind in named
    ]  # fmt: skip
    if not needed:
        return ""
    pairs = [f"{k}: {v!r}" for k, v in given.items() if k != "input_shape"]
    pairs += [f"{name}: ..." for name in needed]
    return f"; give them with --model_args='{{{', '.join(pairs)}}}'"


def build(cls: type, model_args: dict[str, Any] | None, input_shape: tuple[int, ...]) -> Any:
    """`cls(**model_args)` (plus `input_shape` when the constructor takes it), checked to be an
    nn.Module with encode/decode or a LightningModule."""
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
            f"{first_line(e)}{_args_hint(params, kwargs)}"
        ) from e
    if isinstance(obj, L.LightningModule):
        return obj
    missing = [m for m in ("encode", "decode") if not callable(getattr(obj, m, None))]
    if not isinstance(obj, nn.Module) or missing:
        # An autoencoder written as forward(x) -> x_hat alone (the usual first try): ae needs the
        # latent, for ae-encode and the grids
        own_forward = isinstance(obj, nn.Module) and type(obj).forward is not nn.Module.forward
        split = (
            "; split its forward into encode(x) -> z and decode(z) -> x_hat (see 'Your own "
            "model' in docs/TRAINING.md)"
            if own_forward and len(missing) == 2
            else ""
        )
        raise ModelError(
            f"model: {shown} must be a LightningModule, or an nn.Module with encode(x) and "
            f"decode(z); it is a {type(obj).__name__}"
            + (f" without {' and '.join(missing)}" if missing else "")
            + split
        )
    return obj
