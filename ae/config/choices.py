"""The values some flags choose among, declared once (`ae.config.checks` holds each flag to
them): the built-in models, the form of a user model's import path, the downsampling factors,
and the loggers with what installs each."""

from __future__ import annotations

import re

BUILTIN_MODELS = ("auto", "mlp", "conv", "resnet")
# `package.module:ClassName`: a class of the user's, imported by path.
USER_MODEL = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*")
DOWNSAMPLE_FACTORS = (2, 4, 8, 16)
# `--logger` choices -> (the module that must be importable, what `pip install -e` installs it
# with). csv needs nothing; tensorboard is a dependency of ae; wandb and mlflow are extras.
LOGGERS: dict[str, tuple[str, str] | None] = {
    "csv": None,
    "tensorboard": ("tensorboard", "."),
    "wandb": ("wandb", ".[wandb]"),
    "mlflow": ("mlflow", ".[mlflow]"),
}
