"""Flat flags and YAML -> `Config`: coercion, ranges, the cross-field checks, and --help. Every
problem is collected before failing, so a user fixes a bad command in one go."""

from __future__ import annotations

import difflib
import os
import re
import types
import typing
from dataclasses import fields
from pathlib import Path
from typing import Any, Literal

import yaml

from ae.config.checks import BUILTIN_KNOBS, cross_checks
from ae.config.choices import USER_MODEL
from ae.config.sections import FIELDS, NO_VALIDATION, SECTIONS, Config, show_value
from ae.errors import UserError


class ConfigError(UserError):
    """Bad user input. `problems` holds one line per offending key."""

    def __init__(self, problems: list[str]) -> None:
        self.problems = problems
        # The flags that parsed (the others at their defaults): where a launcher that stops
        # tells the others (`ae.job.same_job.tell_leader`). None: not from parse_config.
        self.partial: Config | None = None
        super().__init__("\n".join(problems))

    def render(self) -> str:
        n = len(self.problems)
        head = f"{n} problem{'s' if n > 1 else ''} in the configuration:"
        return "\n".join([head, *(f"  - {p}" for p in self.problems)])


_TYPES = {k: v for cls in SECTIONS.values() for k, v in typing.get_type_hints(cls).items()}
# Names other tools use for our flags, for "did you mean" (spelling slips are difflib's).
ALIASES = {
    "lr": "learning_rate", "bs": "batch_size", "epochs": "max_epochs", "steps": "max_steps",
    "workers": "num_workers", "gpus": "devices", "nproc_per_node": "devices",
    "nodes": "num_nodes", "nnodes": "num_nodes", "out_dir": "output_dir", "output": "output_dir",
    "resume": "resume_from_checkpoint", "ckpt_path": "resume_from_checkpoint",
    "wd": "weight_decay", "warmup": "warmup_steps", "scheduler": "lr_scheduler",
    "accumulate_grad_batches": "gradient_accumulation_steps", "grad_clip": "gradient_clip_val",
    "train_data": "train_shards", "val_data": "val_shards", "shards": "train_shards",
    "image_key": "input_key", "key": "input_key", "resolution": "image_size",
    "size": "image_size", "z_dim": "latent_dim", "latent_size": "latent_dim",
    "mixed_precision": "precision", "save_every": "checkpointing_period",
}  # fmt: skip
# Flags holding paths (a shard spec: paths joined by `::`). The shell expands `~` only at the
# start of a word, never in `--output_dir=~/runs`, nor does YAML: without this a run made a
# folder named `~` in the working directory.
PATH_KEYS = frozenset({
    "config", "output_dir", "train_shards", "val_shards", "resume_from_checkpoint",
    "count_cache", "perceptual_weights", "fid_weights",
})  # fmt: skip
_TRUE = {"true", "1", "yes", "on"}
_FALSE = {"false", "0", "no", "off"}


def _coerce_int(raw: Any) -> int:
    if isinstance(raw, bool) or (isinstance(raw, float) and not raw.is_integer()):
        raise ValueError(f"must be an integer; got {raw!r}")
    try:
        return int(raw) if not isinstance(raw, str) else int(raw.strip())
    except (TypeError, ValueError):  # TypeError: a YAML list or mapping
        raise ValueError(f"must be an integer; got {raw!r}") from None


# An empty value is never a setting: `--train_shards=$DATA` with DATA unset would otherwise
# train on the default (the demo digits) and exit 0. YAML's null (`val_shards: null`, as a saved
# config writes an unset key) is the unset default of a key that has one.
EMPTY = "empty value; give one, or leave the key out for its default"


def _coerce(key: str, raw: Any) -> Any:
    """Convert a CLI string or YAML value to the field's type; raise ValueError with a reason."""
    hint = _TYPES[key]
    args = typing.get_args(hint)
    optional = isinstance(hint, types.UnionType) and type(None) in args
    if (isinstance(raw, str) and not raw.strip()) or (raw is None and not optional):
        raise ValueError(EMPTY)
    if optional:
        if raw is None or (isinstance(raw, str) and raw.lower() in {"none", "null"}):
            # The word, not YAML's null (a saved config's `val_shards: null` is unset).
            word = isinstance(raw, str) and raw.lower() == NO_VALIDATION
            if word and FIELDS[key].metadata["none_is_a_value"]:
                return NO_VALIDATION
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
        joins = FIELDS[key].metadata["joins"]
        if joins and isinstance(raw, list) and raw and all(isinstance(x, str) for x in raw):
            raw = joins.join(raw)  # a YAML list of what the flag joins: `logger: [csv, wandb]`
        if isinstance(raw, dict | list):
            raise ValueError(f"must be a string; got {raw!r}")
        return expand_home(str(raw)) if key in PATH_KEYS else str(raw)
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
                # The problem and where, as for a --config file's ("expected ',' or '}', but
                # got '<stream end>'"), not only the context ("while parsing a flow mapping").
                mark, problem = getattr(e, "problem_mark", None), getattr(e, "problem", None)
                where = f" at column {mark.column + 1} of {raw!r}" if mark is not None else ""
                why = problem or str(e).splitlines()[0]
                raise ValueError(f"not YAML/JSON: {why}{where}") from None
        if value is None:
            return None
        if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
            raise ValueError(
                f"must be a mapping of names to values, e.g. '{{width: 64}}'; got {raw!r}"
            )
        # `{latent:4}` is YAML for {"latent:4": None}: the constructor then failed in every rank
        # on an argument named `latent:4`
        if glued := [k for k, v in value.items() if v is None and ":" in k]:
            name, _, val = glued[0].partition(":")
            raise ValueError(
                f"{glued[0]!r} is a name without a value: YAML needs a space after the colon "
                f"({{{name}: {val}}}); got {raw!r}"
            )
        return value
    raise TypeError(f"unsupported config type for {key}: {hint}")  # programming error


def expand_home(value: str) -> str:
    """`~/x` and `~user/x` as the shell would have expanded them, in each `::`-joined part."""
    return "::".join(os.path.expanduser(part) for part in value.split("::"))


def _split_by_the_shell(values: list[str]) -> bool:
    """Whether a shard spec's repeated values are the files of one unquoted brace pattern: the
    shell expands `--train_shards=a-{000000..000099}.tar` into one flag per file, and the last
    one alone would train. Such values are plain names that differ in their digits alone; a spec
    given again on purpose (a script's later flag overriding its defaults) is not refused.
    A URL's one colon (`http://h:8000/a-000001.tar`) is plain; `::` joins several specs."""
    plain = all(not set(v) & set("{}*?[]") and "::" not in v for v in values)
    return plain and len(set(values)) > 1 and len({re.sub(r"\d+", "#", v) for v in values}) == 1


def _shell_split(key: str, values: list[str], words: bool = False) -> str:
    """The message for a spec the shell split: into flags (`--key=a-{0..7}.tar` unquoted: one
    flag per file) or, `words`, into separate words (`--key a-{0..7}.tar`)."""
    shown = ", ".join(values[:2]) + (f" and {len(values) - 2} more" if len(values) > 2 else "")
    how, what = (
        (f"its value came as {len(values)} separate arguments", "pattern or glob into one word")
        if words
        else (f"given {len(values)} times", "pattern into one flag")
    )
    return (
        f"{key}: {how} ({shown}): the shell expands an unquoted {{a..b}} {what} per file; quote "
        f"the spec (--{key}='data/train-{{000000..000099}}.tar'), or join several with ::"
    )


def _split_argv(argv: list[str], problems: list[str], user: bool = False) -> dict[str, str]:
    """`--key=value`, `--key value`, and a bare `--flag` (true) for booleans; a flag given again
    wins. `user`: argv as typed, where a shard spec split by the shell is refused (a rank's argv
    repeats the flags its launcher appends, the later winning)."""
    out: dict[str, str] = {}
    specs: dict[str, list[str]] = {"train_shards": [], "val_shards": []}
    strays: dict[str, list[str]] = {}  # words right after a spec's value: the shell split it
    last = ""
    i = 0
    while i < len(argv):
        arg = argv[i]
        i += 1
        if not arg.startswith("--") or arg == "--":
            if last in specs:  # `--train_shards a-{0..7}.tar` unquoted: a-1.tar ... follow
                strays.setdefault(last, []).append(arg)
            else:
                problems.append(f"unexpected argument {arg!r}: flags look like --key=value")
            continue
        key, eq, value = arg[2:].partition("=")
        key = key.replace("-", "_")
        if not eq:
            nxt = argv[i] if i < len(argv) else None
            if key in FIELDS and _TYPES[key] is bool and (nxt is None or nxt.startswith("--")):
                value = "true"
            elif nxt is None or nxt.startswith("--"):
                # `--config --batch_size=8` read the next flag as the value: "config: file not
                # found: --batch_size=8". No flag's value starts with `--`.
                after = "" if nxt is None else f"; the next argument, {nxt}, is a flag"
                problems.append(f"{key}: missing value{after} (--{key}=VALUE)")
                continue
            else:
                value, i = nxt, i + 1
        out[key] = value
        specs.get(key, []).append(value)
        last = key
    problems += [_shell_split(k, [out[k], *v], words=True) for k, v in strays.items()]
    if user:
        problems += [_shell_split(k, v) for k, v in specs.items() if _split_by_the_shell(v)]
    return out


def did_you_mean(key: str) -> str | None:
    """The flag a user most likely meant by an unknown `key`: a name from another tool
    (`lr`), the same name without its underscores (`batchsize`), or a close spelling."""
    if key in ALIASES:
        return ALIASES[key]
    squashed = {name.replace("_", ""): name for name in FIELDS}
    if key.replace("_", "") in squashed:
        return squashed[key.replace("_", "")]
    close = difflib.get_close_matches(key, list(FIELDS), n=1, cutoff=0.75)
    return close[0] if close else None


def _unknown(key: str, where: str | None, own_class: bool = False, value: object = None) -> str:
    """`where`: `file, line N` for a key of a --config file; None for a flag. `own_class`: the
    run trains a class of the user's, whose arguments go in --model_args, not in flags of
    their own (`--latent=4`); a guess at a built-in network's flag (`--latent_dim`) is no help."""
    guess = did_you_mean(key)
    if own_class and guess in BUILTIN_KNOBS:
        guess = None
    own = ""  # with a guess (`--batchsize`), that flag is what was meant
    if own_class and guess is None and where is None:
        own = f"; an argument of your own class goes in --model_args='{{{key}: {value}}}'"
    elif own_class and guess is None:
        own = f"; an argument of your own class goes under model_args: ({key}: {value})"
    if where is None:
        hint = f"; did you mean --{guess}?" if guess else ""
        return f"{key}: unknown flag --{key}{hint}{own} (--help lists every flag)"
    hint = f"; did you mean {guess}?" if guess else ""
    return f"{key}: unknown key in {where}{hint}{own} (--help lists every key)"


def _read_yaml(path: str, problems: list[str]) -> tuple[dict[str, Any], dict[str, int]]:
    """The file's mapping, and the line of each of its keys."""
    try:
        text = Path(path).read_text()
        data = yaml.safe_load(text)
    except FileNotFoundError:
        problems.append(f"config: file not found: {path}")
        return {}, {}
    except IsADirectoryError:
        problems.append(f"config: {path} is a folder; give a YAML file (--config=run.yaml)")
        return {}, {}
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        at = f", line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problems.append(f"config: {path}{at}: not valid YAML: {e.problem or e.context}")
        return {}, {}
    except (OSError, yaml.YAMLError) as e:
        problems.append(f"config: cannot read {path}: {e}".splitlines()[0])
        return {}, {}
    if data is None:
        return {}, {}
    if not isinstance(data, dict):
        problems.append(f"config: {path} must hold a mapping of key: value")
        return {}, {}
    root = yaml.compose(text)
    lines: dict[str, int] = {}
    for k, _ in root.value if isinstance(root, yaml.MappingNode) else []:
        if not isinstance(k, yaml.ScalarNode):
            continue
        line = k.start_mark.line + 1
        if k.value in lines:  # PyYAML keeps the last without a word: which one was meant?
            problems.append(
                f"{k.value}: given twice in {path} (lines {lines[k.value]} and {line}); keep one"
            )
        lines.setdefault(k.value, line)
    return data, lines


def _check_range(key: str, value: Any) -> str | None:
    meta = FIELDS[key].metadata
    lo, hi = meta.get("lo"), meta.get("hi")
    for item in value if isinstance(value, tuple) else (value,):  # a list: each of its items
        if isinstance(item, int | float) and not isinstance(item, bool):
            if lo is not None and item < lo:
                return f"{key}: must be >= {lo:g}; got {show_value(value)}"
            if hi is not None and item > hi:
                return f"{key}: must be <= {hi:g}; got {show_value(value)}"
    return None


def parse_config(argv: list[str], *, user: bool = False) -> Config:
    """Build a Config from command-line args (and the YAML file they name); collect all problems.
    `user`: `argv` is the command line as the user typed it (the launcher's)."""
    problems: list[str] = []
    cli = _split_argv(argv, problems, user)
    merged: dict[str, Any] = {}
    where: dict[str, str] = {}  # a key of the config file: where it is
    if cli.get("config", "").strip():  # an empty one: the problem of an empty value, below
        data, lines = _read_yaml(expand_home(cli["config"]), problems)
        for key, value in data.items():
            if key == "config":
                problems.append("config: a config file cannot name another config file")
                continue
            merged[key] = value
            where[key] = f"{cli['config']}, line {lines.get(str(key), '?')}"
    merged.update(cli)

    values: dict[str, Any] = {}
    own_class = USER_MODEL.fullmatch(str(merged.get("model", ""))) is not None
    for key, raw in merged.items():
        if key not in FIELDS:
            problems.append(_unknown(key, None if key in cli else where.get(key), own_class, raw))
            continue
        # A value of the config file: the problem says where it is.
        at = f" (in {where[key]})" if key in where and key not in cli else ""
        try:
            values[key] = _coerce(key, raw)
        except ValueError as e:
            problems.append(f"{key}: {e}{at}")
            continue
        if (msg := _check_range(key, values[key])) is not None:
            problems.append(msg + at)
    # Cross-field checks run on the values that parsed (defaults elsewhere), so one message
    # carries every problem; a check involving a key that is already wrong is skipped.
    bad = {p.split(":")[0] for p in problems}
    values = {k: v for k, v in values.items() if k not in bad}
    cfg = Config.from_flat(values)
    problems += [msg for keys, msg in cross_checks(cfg) if not bad & set(keys)]
    if problems:
        err = ConfigError(problems)
        err.partial = cfg
        raise err
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
                f"default {show_value(f.default)}]"
            )
    return "\n".join(lines)
