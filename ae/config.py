"""Run configuration: every flag is declared once here, with its type, default, range and help.

Sources, later wins: field defaults < `--config FILE.yaml` < command-line flags. Parsing and
validation collect *every* problem before failing, so a user fixes a bad command in one go.
This module imports no torch: the launcher validates flags in well under a second, before any
worker process exists.
"""

from __future__ import annotations

import dataclasses
import os
import types
import typing
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Literal

import yaml


class ConfigError(ValueError):
    """Bad user input. `problems` holds one line per offending key."""

    def __init__(self, problems: list[str]) -> None:
        self.problems = problems
        super().__init__("\n".join(problems))

    def render(self) -> str:
        n = len(self.problems)
        head = f"{n} problem{'s' if n > 1 else ''} in the configuration:"
        return "\n".join([head, *(f"  - {p}" for p in self.problems)])


def _opt(default: Any, help: str, *, lo: float | None = None, hi: float | None = None) -> Any:
    return field(default=default, metadata={"help": help, "lo": lo, "hi": hi})


@dataclass
class Config:
    """Train an autoencoder on WebDataset shards across ranks, with per-rank logs."""

    config: str | None = _opt(None, "YAML file with any of these keys; flags override it")
    print_config: bool = _opt(False, "print the resolved config as YAML and exit")
    debug: bool = _opt(False, "per-batch and per-shard progress lines in the debug_rank logs")
    output_dir: str = _opt("runs/ae", "run folder: logs/ and checkpoints/ go below it")
    train_shards: str | None = _opt(
        None, "shard spec (brace, glob, dir, pipe:CMD, http(s)://); default: demo digits"
    )
    val_shards: str | None = _opt(None, "validation shard spec; default: demo digits val split")
    batch_size: int = _opt(32, "samples per batch per device", lo=1)
    num_workers: int = _opt(2, "dataloader worker processes per rank", lo=0, hi=64)
    shard_split: Literal["drop", "pad"] = _opt(
        "drop", "even split across ranks: drop the remainder, or pad by repeating samples"
    )
    shuffle_buffer: int = _opt(1000, "samples in each worker's shuffle buffer (0 = off)", lo=0)
    tar_reader: Literal["fast", "tarfile"] = _opt(
        "fast", "tar parsing: fast (header cutting) or tarfile (Python's module, the reference)"
    )
    devices: str = _opt("auto", "processes per node: a number, or auto (all GPUs, else 2 CPU)")
    num_nodes: int = _opt(1, "number of nodes", lo=1)
    accelerator: Literal["auto", "cpu", "gpu"] = _opt("auto", "auto picks gpu when CUDA is present")
    max_epochs: int = _opt(5, "stop after this many epochs (-1 = no limit)", lo=-1)
    max_steps: int = _opt(-1, "stop after this many optimizer steps (-1 = no limit)", lo=-1)
    learning_rate: float = _opt(1e-3, "base learning rate, before scaling by world size", lo=0)
    lr_scale: Literal["linear", "sqrt", "none"] = _opt(
        "sqrt", "scale the base LR by world size: linear, sqrt (AdamW-friendly) or none"
    )
    warmup_steps: int = _opt(50, "linear LR warmup over this many optimizer steps", lo=0)
    lr_scheduler: Literal["cosine", "constant"] = _opt(
        "cosine", "LR after warmup: cosine decay to 0 at the last step, or constant"
    )
    encoder_lr_mult: float = _opt(1.0, "encoder LR = effective LR x this", lo=0)
    decoder_lr_mult: float = _opt(1.0, "decoder LR = effective LR x this", lo=0)
    weight_decay: float = _opt(1e-4, "AdamW weight decay", lo=0)
    gradient_accumulation_steps: int = _opt(1, "batches per optimizer step", lo=1)
    gradient_clip_val: float = _opt(1.0, "clip gradient norm to this (0 = off)", lo=0)
    latent_dim: int = _opt(16, "size of the autoencoder bottleneck", lo=1)
    hidden_dim: int = _opt(256, "width of hidden layers (MLP) / base channels x8 (conv)", lo=8)
    val_interval: int = _opt(
        0, "also validate every N optimizer steps (0 = at epoch end only)", lo=0
    )
    checkpointing_period: int = _opt(
        500, "optimizer steps between step checkpoints (0 = only at the end)", lo=0
    )
    checkpoints_total_limit: int = _opt(3, "keep at most this many step checkpoints", lo=1)
    save_best: bool = _opt(True, "also keep best.ckpt, the one with the lowest val loss")
    resume_from_checkpoint: str | None = _opt(
        None, "checkpoint path, or last (<output_dir>/checkpoints/last.ckpt, if any)"
    )
    sample_period: int = _opt(-1, "reconstruction sampling every N steps (-1 = off)", lo=-1)
    sample_batch_size: int = _opt(16, "per-device batch for sampling", lo=1)
    num_sample_batches: int = _opt(1, "batches reconstructed per sampling", lo=1)
    precision: Literal["32", "bf16-mixed", "16-mixed"] = _opt("32", "numeric precision")
    log_every_n_train_batches: int = _opt(500, "progress line cadence in training", lo=1)
    log_every_n_val_batches: int = _opt(20, "progress line cadence in validation", lo=1)
    stall_timeout: float = _opt(
        300.0, "seconds without progress before a STALL report (0 = no watchdog)", lo=0
    )
    pg_timeout: float = _opt(
        600.0, "collective timeout (s): ranks waiting on a dead or stuck peer then fail", lo=1
    )
    log_rotate_mb: float = _opt(0.0, "rotate each log file at this size in MB (0 = never)", lo=0)
    log_rotate_keep: int = _opt(3, "rotated files kept per log (name.log.1 .. .N)", lo=1)
    seed: int = _opt(42, "random seed (data order, init)", lo=0)

    @property
    def logs_dir(self) -> Path:
        return Path(self.output_dir) / "logs"

    @property
    def checkpoints_dir(self) -> Path:
        return Path(self.output_dir) / "checkpoints"

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_yaml(self) -> str:
        skip = {"config", "print_config"}
        return yaml.safe_dump(
            {k: v for k, v in self.to_dict().items() if k not in skip}, sort_keys=False
        )

    def write_yaml(self, path: Path) -> None:
        """The resolved config as a `--config` file; written whole or not at all."""
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(self.to_yaml())
        os.replace(tmp, path)


FIELDS = {f.name: f for f in fields(Config)}
_TYPES = typing.get_type_hints(Config)
_TRUE = {"true", "1", "yes", "on"}
_FALSE = {"false", "0", "no", "off"}


def _coerce(key: str, raw: Any) -> Any:
    """Convert a CLI string or YAML value to the field's type; raise ValueError with a reason."""
    hint = _TYPES[key]
    args = typing.get_args(hint)
    optional = isinstance(hint, types.UnionType) and type(None) in args
    if optional:
        if raw is None or (isinstance(raw, str) and raw.lower() in {"none", "null", ""}):
            return None
        hint = next(a for a in args if a is not type(None))
    if typing.get_origin(hint) is Literal:
        choices = typing.get_args(hint)
        value = str(raw)
        if value not in choices:
            raise ValueError(f"must be one of {', '.join(choices)}; got {raw!r}")
        return value
    if hint is bool:
        if isinstance(raw, bool):
            return raw
        if str(raw).lower() in _TRUE:
            return True
        if str(raw).lower() in _FALSE:
            return False
        raise ValueError(f"must be true or false; got {raw!r}")
    if hint is int:
        if isinstance(raw, bool) or (isinstance(raw, float) and not raw.is_integer()):
            raise ValueError(f"must be an integer; got {raw!r}")
        try:
            return int(raw) if not isinstance(raw, str) else int(raw.strip())
        except ValueError:
            raise ValueError(f"must be an integer; got {raw!r}") from None
    if hint is float:
        # PyYAML reads `1e-4` (no dot) as a string: float() accepts it, as users expect.
        if isinstance(raw, bool):
            raise ValueError(f"must be a number; got {raw!r}")
        try:
            return float(raw)
        except (TypeError, ValueError):
            raise ValueError(f"must be a number; got {raw!r}") from None
    if hint is str:
        if isinstance(raw, dict | list):
            raise ValueError(f"must be a string; got {raw!r}")
        return str(raw)
    raise TypeError(f"unsupported config type for {key}: {hint}")  # programming error


def _split_argv(argv: list[str], problems: list[str]) -> dict[str, str]:
    """`--key=value`, `--key value`, and a bare `--flag` (true) for booleans."""
    out: dict[str, str] = {}
    i = 0
    while i < len(argv):
        arg = argv[i]
        i += 1
        if not arg.startswith("--") or arg == "--":
            problems.append(f"unexpected argument {arg!r}: flags look like --key=value")
            continue
        key, eq, value = arg[2:].partition("=")
        key = key.replace("-", "_")
        if not eq:
            nxt = argv[i] if i < len(argv) else None
            if key in FIELDS and _TYPES[key] is bool and (nxt is None or nxt.startswith("--")):
                value = "true"
            elif nxt is None:
                problems.append(f"--{key}: missing value")
                continue
            else:
                value, i = nxt, i + 1
        out[key] = value
    return out


def _read_yaml(path: str, problems: list[str]) -> dict[str, Any]:
    try:
        data = yaml.safe_load(Path(path).read_text())
    except FileNotFoundError:
        problems.append(f"config: file not found: {path}")
        return {}
    except (OSError, yaml.YAMLError) as e:
        problems.append(f"config: cannot read {path}: {e}".splitlines()[0])
        return {}
    if data is None:
        return {}
    if not isinstance(data, dict):
        problems.append(f"config: {path} must hold a mapping of key: value")
        return {}
    return data


def _check_range(key: str, value: Any) -> str | None:
    meta = FIELDS[key].metadata
    lo, hi = meta.get("lo"), meta.get("hi")
    if isinstance(value, int | float) and not isinstance(value, bool):
        if lo is not None and value < lo:
            return f"{key}: must be >= {lo:g}; got {value}"
        if hi is not None and value > hi:
            return f"{key}: must be <= {hi:g}; got {value}"
    return None


def _cross_checks(cfg: Config) -> list[tuple[tuple[str, ...], str]]:
    """Problems between fields (and with the resume path), each with the keys it involves."""
    problems: list[tuple[tuple[str, ...], str]] = []

    def need(ok: bool, keys: tuple[str, ...], message: str) -> None:
        if not ok:
            problems.append((keys, f"{'/'.join(keys)}: {message}"))

    need(
        cfg.max_epochs != -1 or cfg.max_steps != -1,
        ("max_epochs", "max_steps"),
        "at least one stop condition must be set",
    )
    need(
        cfg.devices == "auto" or (cfg.devices.isdigit() and int(cfg.devices) >= 1),
        ("devices",),
        f"must be a positive integer or auto; got {cfg.devices!r}",
    )
    need(
        not (cfg.precision == "16-mixed" and cfg.accelerator == "cpu"),
        ("precision",),
        "16-mixed needs a GPU; use 32 or bf16-mixed on CPU",
    )
    need(
        cfg.pg_timeout <= 0 or cfg.stall_timeout <= 0 or cfg.pg_timeout > cfg.stall_timeout,
        ("pg_timeout",),
        f"must be above stall_timeout ({cfg.stall_timeout:g}s), or a rank waiting for a stuck"
        " peer fails before the stall is reported",
    )
    need(
        cfg.sample_period != 0,
        ("sample_period",),
        "use -1 to turn sampling off, or a positive step count",
    )
    need(
        cfg.max_steps == -1 or cfg.sample_period <= cfg.max_steps,
        ("sample_period", "max_steps"),
        f"sampling every {cfg.sample_period} steps never runs in a run of {cfg.max_steps} "
        "steps; use -1 to turn it off",
    )
    need(
        cfg.encoder_lr_mult > 0 or cfg.decoder_lr_mult > 0,
        ("encoder_lr_mult", "decoder_lr_mult"),
        "both 0 would freeze the whole model",
    )
    resume = cfg.resume_from_checkpoint
    need(
        resume in (None, "last") or Path(resume).is_file(),
        ("resume_from_checkpoint",),
        f"no such checkpoint file: {resume} (a path, or last)",
    )
    return problems


def parse_config(argv: list[str]) -> Config:
    """Build a Config from command-line args (and the YAML file they name); collect all problems."""
    problems: list[str] = []
    cli = _split_argv(argv, problems)
    merged: dict[str, Any] = {}
    if cli.get("config"):
        for key, value in _read_yaml(cli["config"], problems).items():
            if key == "config":
                problems.append("config: a config file cannot name another config file")
                continue
            merged[key] = value
    merged.update(cli)

    values: dict[str, Any] = {}
    for key, raw in merged.items():
        if key not in FIELDS:
            problems.append(f"{key}: unknown key (see --help for the list)")
            continue
        try:
            values[key] = _coerce(key, raw)
        except ValueError as e:
            problems.append(f"{key}: {e}")
            continue
        if (msg := _check_range(key, values[key])) is not None:
            problems.append(msg)
    # Cross-field checks run on the values that parsed (defaults elsewhere), so one message
    # carries every problem; a check involving a key that is already wrong is skipped.
    bad = {p.split(":")[0] for p in problems}
    values = {k: v for k, v in values.items() if k not in bad}
    cfg = Config(**values)
    problems += [msg for keys, msg in _cross_checks(cfg) if not bad & set(keys)]
    if problems:
        raise ConfigError(problems)
    return cfg


def help_text() -> str:
    lines = [Config.__doc__ or "", "", "flags (--key=value or --key value; YAML keys alike):"]
    for f in fields(Config):
        hint = _TYPES[f.name]
        kind = "|".join(typing.get_args(hint)) if typing.get_origin(hint) is Literal else None
        if kind is None:
            kind = getattr(hint, "__name__", str(hint)).replace(" | None", "")
        lines.append(f"  --{f.name:<28} {f.metadata['help']} [{kind}, default {f.default}]")
    return "\n".join(lines)
