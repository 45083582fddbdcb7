"""Run configuration: every flag is declared once here, with its type, default, range and help.

Flags stay flat on the command line and in YAML (`--batch_size=64`, `batch_size: 64`), but each
is declared in the section of the concern that uses it, and each component receives only its
section: the data module a `DataConfig`, the model a `ModelConfig`, and so on. `Config` is the
whole, built by `parse_config`.

Sources, later wins: field defaults < `--config FILE.yaml` < command-line flags. Parsing and
validation collect *every* problem before failing, so a user fixes a bad command in one go.
This module imports no torch: the launcher validates flags in well under a second, before any
worker process exists.
"""

from __future__ import annotations

import dataclasses
import re
import types
import typing
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Literal

import yaml

from ae.errors import UserError
from ae.run_dir import RunDir


class ConfigError(UserError):
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


@dataclass(frozen=True)
class RunConfig:
    """The run: its folder, its processes, when it stops."""

    config: str | None = _opt(None, "YAML file with any of these keys; flags override it")
    print_config: bool = _opt(False, "print the resolved config as YAML and exit")
    output_dir: str = _opt("runs/ae", "run folder: logs/ and checkpoints/ go below it")
    overwrite: bool = _opt(
        False, "start afresh in an output_dir holding an earlier run's checkpoints (deletes them)"
    )
    devices: str = _opt("auto", "processes per node: a number, or auto (all GPUs, else 2 CPU)")
    num_nodes: int = _opt(1, "number of nodes", lo=1)
    accelerator: Literal["auto", "cpu", "gpu"] = _opt("auto", "auto picks gpu when CUDA is present")
    precision: Literal["32", "bf16-mixed", "16-mixed"] = _opt("32", "numeric precision")
    max_epochs: int = _opt(5, "stop after this many epochs (-1 = no limit)", lo=-1)
    max_steps: int = _opt(-1, "stop after this many optimizer steps (-1 = no limit)", lo=-1)
    val_interval: int = _opt(
        0, "also validate every N optimizer steps (0 = at epoch end only)", lo=0
    )
    seed: int = _opt(42, "random seed (data order, init)", lo=0)

    @property
    def dir(self) -> RunDir:
        return RunDir(Path(self.output_dir))


@dataclass(frozen=True)
class DataConfig:
    """Shards and the input pipeline."""

    train_shards: str | None = _opt(
        None, "shard spec (brace, glob, dir, pipe:CMD, http(s)://); default: demo digits"
    )
    val_shards: str | None = _opt(None, "validation shard spec; default: demo digits val split")
    batch_size: int = _opt(32, "samples per batch per device", lo=1)
    num_workers: int = _opt(2, "dataloader worker processes per rank", lo=0, hi=64)
    shard_split: Literal["drop", "pad", "resampled"] = _opt(
        "drop",
        "even split across ranks: drop the remainder, pad by repeating samples, or resampled "
        "(no counting: each worker draws whole shards at random with replacement, an epoch is "
        "--epoch_samples; for sets too large or too remote to count)",
    )
    epoch_samples: int = _opt(
        0,
        "samples per training epoch, all ranks together; required by --shard_split=resampled",
        lo=0,
    )
    count_cache: str = _opt(
        "auto",
        "per-user cache of shard sample counts, reused by every run: auto (~/.cache/ae/"
        "shard-counts, or $AE_CACHE_DIR/shard-counts), a folder, or off",
    )
    write_index: Literal["auto", "never"] = _opt(
        "auto", "write the index sidecar of a local shard counted by reading it (writable folders)"
    )
    shuffle_buffer: int = _opt(1000, "samples in each worker's shuffle buffer (0 = off)", lo=0)
    tar_reader: Literal["fast", "tarfile"] = _opt(
        "fast", "tar parsing: fast (header cutting) or tarfile (Python's module, the reference)"
    )
    input_key: str | None = _opt(
        None,
        "sample field to train on, as WebDataset names it (x.npy, image.jpg, jpg; 'jpg;png': "
        "whichever the sample has; x.npz/NAME: one array of an npz); default: the first "
        "decodable field of the first sample (an image field: with any image extension)",
    )
    image_size: int = _opt(
        0,
        "images: resize the shorter side to N, then crop N x N (random crop in training, center "
        "in validation and sampling); 0 = native size, which must then be the same for all",
        lo=0,
    )
    channels: int = _opt(
        0, "images: 1 (grayscale) or 3 (RGB), whatever each image's mode; 0 = as the first", lo=0
    )
    random_flip: bool = _opt(False, "images: flip half of the training images left-right")
    npy_scale: float = _opt(
        1.0,
        "arrays (npy/npz/pth): multiply the float32 values by this (e.g. 0.00392156863 = 1/255 "
        "for uint8 pixels); 1 = values as stored",
    )


BUILTIN_MODELS = ("auto", "mlp", "conv", "resnet")
# Batches each dataloader worker keeps ready (not a flag): they wait in /dev/shm, so the
# preflight (ae.cli.preflight) counts them.
PREFETCH_FACTOR = 4
# `package.module:ClassName`: a class of the user's, imported by path.
USER_MODEL = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*")
DOWNSAMPLE_FACTORS = (2, 4, 8, 16)


@dataclass(frozen=True)
class ModelConfig:
    """The autoencoder (ae/training/README.md has a section per model)."""

    model: str = _opt(
        "auto",
        "auto (mlp for vectors, conv for images), mlp, conv, resnet, or your own class as "
        "package.module:ClassName",
    )
    model_args: dict[str, Any] | None = _opt(  # noqa: RUF009 (the default is None)
        None, "keyword arguments of your own class: a YAML/JSON mapping, e.g. '{width: 64}'"
    )
    latent_dim: int = _opt(16, "mlp, conv: size of the bottleneck vector", lo=1)
    hidden_dim: int = _opt(
        256, "conv: channels of its first stage x8; mlp: widths hidden_dim,hidden_dim/2", lo=8
    )
    hidden_dims: tuple[int, ...] = _opt(
        (), "mlp: widths of the hidden layers, e.g. 1024,512 (overrides hidden_dim)", lo=1
    )
    downsample: int = _opt(
        8, "resnet: stride-2 stages reduce H and W by this factor f (2, 4, 8, 16)", lo=2, hi=16
    )
    latent_channels: int = _opt(4, "resnet: channels of the spatial latent (H/f x W/f)", lo=1)
    base_channels: int = _opt(64, "resnet: channels of the first stage", lo=1)
    channel_mult: tuple[int, ...] = _opt(
        (1, 2, 4, 4), "resnet: channels per resolution (x base_channels), the first log2(f)+1", lo=1
    )
    res_blocks: int = _opt(2, "resnet: residual blocks per resolution", lo=1)
    kl_weight: float = _opt(
        0.0, "> 0: a VAE (mean and log-variance, sampled latent) with this weight on the KL", lo=0
    )
    loss: Literal["mse", "l1", "smooth_l1"] = _opt("mse", "reconstruction loss")
    ema_decay: float = _opt(
        0.0,
        "keep an EMA of the weights (e.g. 0.999) for validation, grids, ae-encode; 0 = off",
        lo=0,
    )
    compile: bool = _opt(False, "run the model through torch.compile")


@dataclass(frozen=True)
class OptimConfig:
    """Learning rate, its schedule and scaling, and the optimizer step."""

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


@dataclass(frozen=True)
class CheckpointConfig:
    """Checkpoints: how often, how many, and where to resume from."""

    checkpointing_period: int = _opt(
        500, "optimizer steps between step checkpoints (0 = only at the end)", lo=0
    )
    checkpoints_total_limit: int = _opt(3, "keep at most this many step checkpoints", lo=1)
    save_best: bool = _opt(True, "also keep best.ckpt, the one with the lowest val loss")
    resume_from_checkpoint: str | None = _opt(
        None, "checkpoint path, or last (<output_dir>/checkpoints/last.ckpt, if any)"
    )


@dataclass(frozen=True)
class ObservabilityConfig:
    """Logs, the stall watchdog, straggler detection, and reconstruction samples."""

    debug: bool = _opt(False, "per-batch and per-shard progress lines in the debug_rank logs")
    log_every_n_train_batches: int = _opt(500, "progress line cadence in training", lo=1)
    log_every_n_val_batches: int = _opt(20, "progress line cadence in validation", lo=1)
    stall_timeout: float = _opt(
        300.0, "seconds without progress before a STALL report (0 = no watchdog)", lo=0
    )
    pg_timeout: float = _opt(
        600.0, "collective timeout (s): ranks waiting on a dead or stuck peer then fail", lo=1
    )
    straggler_factor: float = _opt(
        1.3, "a rank whose own time per step is this x the median is a straggler (0 = off)", lo=0
    )
    straggler_window: float = _opt(
        60.0, "seconds a rank must stay above --straggler_factor to be named a straggler", lo=1
    )
    log_rotate_mb: float = _opt(0.0, "rotate each log file at this size in MB (0 = never)", lo=0)
    log_rotate_keep: int = _opt(3, "rotated files kept per log (name.log.1 .. .N)", lo=1)
    sample_period: int = _opt(-1, "reconstruction sampling every N steps (-1 = off)", lo=-1)
    sample_every_epoch: bool = _opt(
        True, "image data: a reconstruction grid at the end of every epoch too"
    )
    sample_batch_size: int = _opt(16, "per-device batch for sampling", lo=1)
    num_sample_batches: int = _opt(1, "batches reconstructed per sampling", lo=1)


@dataclass(frozen=True)
class Config:
    """Train an autoencoder on WebDataset shards across ranks, with per-rank logs."""

    run: RunConfig = field(default_factory=RunConfig)
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    checkpoints: CheckpointConfig = field(default_factory=CheckpointConfig)
    obs: ObservabilityConfig = field(default_factory=ObservabilityConfig)

    @classmethod
    def from_flat(cls, values: dict[str, Any]) -> Config:
        """From flat `{flag: value}` (missing flags take their defaults)."""
        parts = {
            name: section(**{k: values[k] for k in _SECTION_FLAGS[name] if k in values})
            for name, section in SECTIONS.items()
        }
        return cls(**parts)

    def to_dict(self) -> dict[str, Any]:
        """Flat `{flag: value}`, in --help order."""
        return {
            k: v for name in SECTIONS for k, v in dataclasses.asdict(getattr(self, name)).items()
        }

    def to_yaml(self) -> str:
        skip = {"config", "print_config", "overwrite"}  # actions of one launch, not settings
        return yaml.safe_dump(
            {k: list(v) if isinstance(v, tuple) else v for k, v in self.to_dict().items()
             if k not in skip},
            sort_keys=False,
        )  # fmt: skip


SECTIONS: dict[str, type] = {f.name: f.default_factory for f in fields(Config)}  # type: ignore[misc]
_SECTION_FLAGS = {name: [f.name for f in fields(cls)] for name, cls in SECTIONS.items()}
FIELDS = {f.name: f for cls in SECTIONS.values() for f in fields(cls)}
_TYPES = {k: v for cls in SECTIONS.values() for k, v in typing.get_type_hints(cls).items()}
_TRUE = {"true", "1", "yes", "on"}
_FALSE = {"false", "0", "no", "off"}


def _coerce_int(raw: Any) -> int:
    if isinstance(raw, bool) or (isinstance(raw, float) and not raw.is_integer()):
        raise ValueError(f"must be an integer; got {raw!r}")
    try:
        return int(raw) if not isinstance(raw, str) else int(raw.strip())
    except ValueError:
        raise ValueError(f"must be an integer; got {raw!r}") from None


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
        return _coerce_int(raw)
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
    if typing.get_origin(hint) is tuple:  # tuple[int, ...]: `1,2,4`, or a YAML list
        items = raw if isinstance(raw, list | tuple) else str(raw).strip("[]() ").split(",")
        if isinstance(raw, int) and not isinstance(raw, bool):
            items = [raw]
        try:
            return tuple(_coerce_int(x) for x in items if str(x).strip())
        except ValueError:
            raise ValueError(f"must be integers separated by commas; got {raw!r}") from None
    if typing.get_origin(hint) is dict:  # a YAML mapping, or its text on the command line
        value = raw
        if isinstance(raw, str):
            try:
                value = yaml.safe_load(raw)
            except yaml.YAMLError as e:
                raise ValueError(f"not YAML/JSON: {str(e).splitlines()[0]}") from None
        if value is None:
            return None
        if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
            raise ValueError(f"must be a mapping of names to values; got {raw!r}")
        return value
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
    for item in value if isinstance(value, tuple) else (value,):  # a list: each of its items
        if isinstance(item, int | float) and not isinstance(item, bool):
            if lo is not None and item < lo:
                return f"{key}: must be >= {lo:g}; got {_show(value)}"
            if hi is not None and item > hi:
                return f"{key}: must be <= {hi:g}; got {_show(value)}"
    return None


def _show(value: Any) -> str:
    """A value as the user writes it: lists as `1,2,4`."""
    return ",".join(map(str, value)) if isinstance(value, tuple) else str(value)


def _cross_checks(config: Config) -> list[tuple[tuple[str, ...], str]]:
    """Problems between fields (and with the resume path), each with the keys it involves."""
    problems: list[tuple[tuple[str, ...], str]] = []
    cfg = types.SimpleNamespace(**config.to_dict())  # flat: checks cross the sections

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
        (cfg.shard_split == "resampled") == (cfg.epoch_samples > 0),
        ("shard_split", "epoch_samples"),
        "--shard_split=resampled needs --epoch_samples (the samples of one epoch, all ranks "
        "together), and --epoch_samples only applies to it",
    )
    need(cfg.channels in (0, 1, 3), ("channels",), f"must be 1, 3 or 0 (auto); got {cfg.channels}")
    need(
        cfg.straggler_factor == 0 or cfg.straggler_factor > 1,
        ("straggler_factor",),
        f"must be above 1 (1.3: 30% slower than the median), or 0 for off; got "
        f"{cfg.straggler_factor:g}",
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
    need(
        not (cfg.overwrite and cfg.resume_from_checkpoint is not None),
        ("overwrite", "resume_from_checkpoint"),
        "overwrite deletes the checkpoints that a resume would read; pick one",
    )
    need(
        cfg.model in BUILTIN_MODELS or USER_MODEL.fullmatch(cfg.model) is not None,
        ("model",),
        f"must be one of {', '.join(BUILTIN_MODELS)} or package.module:ClassName; got "
        f"{cfg.model!r}",
    )
    user_model = cfg.model not in BUILTIN_MODELS
    need(
        cfg.model_args is None or user_model,
        ("model_args",),
        "only for your own class (--model=package.module:ClassName)",
    )
    need(
        cfg.kl_weight == 0 or not user_model,
        ("kl_weight",),
        "only for the built-in models; your own class computes its own loss",
    )
    need(
        cfg.downsample in DOWNSAMPLE_FACTORS,
        ("downsample",),
        f"must be one of {', '.join(map(str, DOWNSAMPLE_FACTORS))}; got {cfg.downsample}",
    )
    need(cfg.ema_decay < 1, ("ema_decay",), f"must be below 1 (0 = off); got {cfg.ema_decay}")
    levels = cfg.downsample.bit_length()  # log2(f) + 1 resolutions
    need(
        cfg.model != "resnet" or len(cfg.channel_mult) >= levels,
        ("channel_mult", "downsample"),
        f"downsample {cfg.downsample} has {levels} resolutions, so it needs at least {levels} "
        f"channel multipliers; got {_show(cfg.channel_mult)}",
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
    cfg = Config.from_flat(values)
    problems += [msg for keys, msg in _cross_checks(cfg) if not bad & set(keys)]
    if problems:
        raise ConfigError(problems)
    return cfg


def _kind(hint: Any) -> str:
    """How --help names a type: `mse|l1`, `int`, `int list`, `mapping`."""
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    if isinstance(hint, types.UnionType):  # X | None
        return _kind(args[0])
    if typing.get_origin(hint) is Literal:
        return "|".join(args)
    if typing.get_origin(hint) is tuple:
        return f"{args[0].__name__} list"
    if typing.get_origin(hint) is dict:
        return "mapping"
    return hint.__name__


def help_text() -> str:
    lines = [Config.__doc__ or "", "", "flags (--key=value or --key value; YAML keys alike):"]
    for section in SECTIONS.values():
        lines += ["", f"{section.__doc__}"]
        for f in fields(section):
            lines.append(
                f"  --{f.name:<28} {f.metadata['help']} [{_kind(_TYPES[f.name])}, "
                f"default {_show(f.default)}]"
            )
    return "\n".join(lines)
