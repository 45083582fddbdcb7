"""Run configuration: every flag declared once (`sections`), with type, default, range and help.

Flags stay flat on the command line and in YAML (`--batch_size=64`, `batch_size: 64`), but each
is declared in the section of the concern that uses it, and each component receives only its
section: the data module a `DataConfig`, the model a `ModelConfig`, and so on. `Config` is the
whole, built by `parse_config`.

Sources, later wins: field defaults < `--config FILE.yaml` < command-line flags. Parsing and
validation collect *every* problem before failing, so a user fixes a bad command in one go.
This module imports no torch: the launcher validates flags in well under a second, before any
worker process exists.
"""

from ae.config.checks import logger_names
from ae.config.choices import BUILTIN_MODELS, DOWNSAMPLE_FACTORS, LOGGERS, USER_MODEL
from ae.config.parse import ConfigError, help_text, parse_config
from ae.config.sections import (
    FIELDS,
    NO_VALIDATION,
    PREFETCH_FACTOR,
    SECTIONS,
    CheckpointConfig,
    Config,
    DataConfig,
    ModelConfig,
    ObjectiveConfig,
    ObservabilityConfig,
    OptimConfig,
    RunConfig,
)

__all__ = [
    "BUILTIN_MODELS",
    "DOWNSAMPLE_FACTORS",
    "FIELDS",
    "LOGGERS",
    "NO_VALIDATION",
    "PREFETCH_FACTOR",
    "SECTIONS",
    "USER_MODEL",
    "CheckpointConfig",
    "Config",
    "ConfigError",
    "DataConfig",
    "ModelConfig",
    "ObjectiveConfig",
    "ObservabilityConfig",
    "OptimConfig",
    "RunConfig",
    "help_text",
    "logger_names",
    "parse_config",
]
