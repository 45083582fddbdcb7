"""Problems between flags (and with the resume path): checks that no single flag's type or range
can express, run on the values that parsed."""

from __future__ import annotations

import difflib
import importlib.util
import types
from pathlib import Path

from ae.config.choices import BUILTIN_MODELS, DOWNSAMPLE_FACTORS, LOGGERS, USER_MODEL
from ae.config.model_path import model_spelling_hint
from ae.config.sections import (
    FIELDS,
    Config,
    show_value,
)
from ae.run_paths import RunDir, checkpoints_in_folder

# The flags that shape a built-in network alone (a class of your own takes --model_args).
BUILTIN_KNOBS = (
    "latent_dim", "hidden_dim", "hidden_dims", "downsample", "latent_channels", "base_channels",
    "channel_mult", "res_blocks",
)  # fmt: skip


def logger_names(value: str) -> list[str]:
    """`--logger=csv,tensorboard` -> ["csv", "tensorboard"]."""
    return [name.strip() for name in value.split(",") if name.strip()]


def logger_problems(value: str) -> list[str]:
    """Unknown names, and loggers whose package is missing (named with the extra that installs
    it): found by the launcher, before any process starts."""
    names = logger_names(value)
    if not names:
        return [f"must name at least one of {', '.join(LOGGERS)}"]
    problems = [f"{name} is listed twice" for name in sorted(set(names)) if names.count(name) > 1]
    for name in names:
        if name not in LOGGERS:
            # A slip of the keys or of case (`tensorbord`, `TensorBoard`): the name meant.
            near = difflib.get_close_matches(name.lower(), list(LOGGERS), n=1, cutoff=0.6)
            hint = f" (did you mean {near[0]}?)" if near else ""
            problems.append(f"unknown logger {name!r}{hint}; choose from {', '.join(LOGGERS)}")
        elif (need := LOGGERS[name]) and importlib.util.find_spec(need[0]) is None:
            problems.append(
                f"{name} is not installed; install it with .venv/bin/pip install -e '{need[1]}'"
            )
    return problems


# Lightning runs bf16-mixed instead on a CPU, and says so only in the rank's log: refused (the
# launcher also refuses it with --accelerator=auto where no GPU is visible).
CPU_16_MIXED = (
    "16-mixed needs a GPU, and this run has none (on a CPU, Lightning would run bf16-mixed "
    "instead); use --precision=32 or --precision=bf16-mixed"
)


def cross_checks(config: Config) -> list[tuple[tuple[str, ...], str]]:
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
    for key in ("max_epochs", "max_steps"):
        need(getattr(cfg, key) != 0, (key,), "0 would train nothing; at least 1, or -1: no limit")
    need(
        cfg.devices == "auto" or (cfg.devices.isdigit() and int(cfg.devices) >= 1),
        ("devices",),
        f"must be a positive integer or auto; got {cfg.devices!r}",
    )
    need(
        not (cfg.precision == "16-mixed" and cfg.accelerator == "cpu"),
        ("precision",),
        CPU_16_MIXED,
    )
    need(
        cfg.pg_timeout <= 0 or cfg.stall_timeout <= 0 or cfg.pg_timeout > cfg.stall_timeout,
        ("pg_timeout",),
        f"must be above stall_timeout ({cfg.stall_timeout:g}s), or a rank waiting for a stuck"
        " peer fails before the stall is reported",
    )
    # The watchdog is what ends a hung rank: --stall_timeout=0 (no watchdog) with a
    # --hang_timeout asked for would train on with no hang restart and no word. The default
    # hang_timeout goes quietly with the watchdog (the help says so).
    need(
        cfg.stall_timeout > 0 or cfg.hang_timeout in (0, FIELDS["hang_timeout"].default),
        ("hang_timeout", "stall_timeout"),
        f"--hang_timeout={cfg.hang_timeout:g} needs the watchdog, which --stall_timeout=0 turns "
        "off: give --stall_timeout a value below it (300: the default), or --hang_timeout=0",
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
        f"{cfg.model!r}{model_spelling_hint(cfg.model, BUILTIN_MODELS)}",
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
    # Set for your own class, these were ignored without a word: they shape only mlp/conv/resnet.
    own_class = USER_MODEL.fullmatch(cfg.model) is not None  # not a misspelt built-in
    for knob in BUILTIN_KNOBS:
        value = getattr(cfg, knob)
        shown = f"[{', '.join(map(str, value))}]" if isinstance(value, tuple) else value
        need(
            value == FIELDS[knob].default or not own_class,
            (knob,),
            f"only for the built-in models ({', '.join(BUILTIN_MODELS[1:])}); your own class "
            f"takes its arguments in --model_args, e.g. --model_args='{{{knob}: {shown}}}'",
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
        f"channel multipliers; got {show_value(cfg.channel_mult)} (e.g. --channel_mult="
        + ",".join(map(str, [*cfg.channel_mult, *cfg.channel_mult[-1:] * levels, 1][:levels]))
        + ")",
    )
    for problem in logger_problems(cfg.logger):
        need(False, ("logger",), problem)
    resume = cfg.resume_from_checkpoint
    folder = checkpoints_in_folder(Path(resume)) if resume not in (None, "last") else None
    need(
        resume in (None, "last") or Path(resume).is_file(),
        ("resume_from_checkpoint",),
        # A run folder or its checkpoints/ (was: "no such checkpoint file" of a folder there)
        f"{resume} is a folder{folder}, or last"
        if folder is not None
        else f"no such checkpoint file: {resume} (a path, or last)"
        f"{_in_run_folder(resume, cfg.output_dir) or _checkpoints_beside(resume)}",
    )
    return problems


def _in_run_folder(resume: str | None, output_dir: str) -> str:
    """A checkpoint's bare name (`best`, `step-00000046.ckpt`) that names one in the run folder's
    checkpoints/: `; did you mean <its path>?`, else ""."""
    if resume in (None, "last") or Path(resume).is_absolute() or "/" in resume:
        return ""
    folder = RunDir(Path(output_dir).expanduser()).checkpoints
    for name in (resume, f"{resume}.ckpt"):
        if (folder / name).is_file():
            return f"; did you mean --resume_from_checkpoint={folder / name}?"
    return ""


def _checkpoints_beside(resume: str | None) -> str:
    """The checkpoints in the folder a missing one was named in (a mistyped step number, one
    pruned since): `; its folder holds last.ckpt, step-00000040.ckpt, step-00000046.ckpt`."""
    folder = Path(resume).parent if resume not in (None, "last") else None
    found = sorted(p.name for p in folder.glob("*.ckpt")) if folder and folder.is_dir() else []
    return f"; {folder} holds {', '.join(found)}" if found else ""
