import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from ae.config import FIELDS, ConfigError, help_text, logger_names, parse_config


def test_defaults_and_cli_forms() -> None:
    cfg = parse_config(["--batch_size=8", "--num_workers", "1", "--debug"])
    assert (cfg.data.batch_size, cfg.data.num_workers, cfg.obs.debug) == (8, 1, True)
    assert parse_config(["--debug=false"]).obs.debug is False
    assert parse_config([]).obs.log_every_n_train_batches == 500


@pytest.mark.parametrize("text", ["1e-4", "1E-4", "0.0001", "1.0e-4"])
def test_yaml_scientific_learning_rate_is_float(tmp_path: Path, text: str) -> None:
    path = tmp_path / "c.yaml"
    path.write_text(f"learning_rate: {text}\nbatch_size: 4\n")
    cfg = parse_config([f"--config={path}"])
    assert cfg.optim.learning_rate == pytest.approx(0.0001)
    assert isinstance(cfg.optim.learning_rate, float)


def test_cli_overrides_yaml(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("batch_size: 4\nseed: 3\n")
    cfg = parse_config([f"--config={path}", "--batch_size", "16"])
    assert (cfg.data.batch_size, cfg.run.seed) == (16, 3)


def test_yaml_lists_of_what_a_flag_joins(tmp_path: Path) -> None:
    """`logger: [csv, tensorboard]` and a list of shard specs read as the flags' joined forms;
    a list where one string is meant is still refused, by name."""
    path = tmp_path / "run.yaml"
    path.write_text("logger: [csv, tensorboard]\ntrain_shards:\n  - a/{0..3}.tar\n  - b/*.tar\n")
    cfg = parse_config([f"--config={path}"])
    assert cfg.obs.logger == "csv,tensorboard"
    assert cfg.data.train_shards == "a/{0..3}.tar::b/*.tar"
    path.write_text("output_dir: [a, b]\n")
    with pytest.raises(ConfigError) as err:
        parse_config([f"--config={path}"])
    assert "output_dir" in err.value.problems[0] and "must be a string" in err.value.problems[0]


def test_unknown_key_in_yaml_is_named_with_its_file_line_and_a_guess(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("seed: 1\nbatch_sise: 4\n")
    with pytest.raises(ConfigError) as err:
        parse_config([f"--config={path}"])
    assert err.value.problems == [
        f"batch_sise: unknown key in {path}, line 2; did you mean batch_size? (--help lists "
        "every key)"
    ]


@pytest.mark.parametrize(
    ("flag", "meant"),
    [("--batchsize=8", "batch_size"), ("--lr=abc", "learning_rate"),
     ("--lerning_rate=1", "learning_rate"), ("--epochs=3", "max_epochs")],
)  # fmt: skip
def test_unknown_flags_suggest_the_flag_meant(flag: str, meant: str) -> None:
    with pytest.raises(ConfigError) as err:
        parse_config([flag])
    (problem,) = err.value.problems
    assert f"did you mean --{meant}?" in problem and problem.startswith(flag[2:].split("=")[0])


def test_unknown_flag_without_a_likely_meaning_gets_no_guess() -> None:
    with pytest.raises(ConfigError) as err:
        parse_config(["--xyzzy=1"])
    assert err.value.problems == ["xyzzy: unknown flag --xyzzy (--help lists every flag)"]


@pytest.mark.parametrize(
    ("text", "line", "column"),
    [("seed: 1\nbatch_size: [4\nx: 2\n", 3, 2), ("seed: 1\n  batch_size: 4\n", 2, 13)],
)
def test_yaml_syntax_error_names_file_line_and_column(
    tmp_path: Path, text: str, line: int, column: int
) -> None:
    path = tmp_path / "c.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as err:
        parse_config([f"--config={path}"])
    (problem,) = err.value.problems
    assert problem.startswith(f"config: {path}, line {line}, column {column}: not valid YAML: ")


def test_all_problems_reported_together() -> None:
    with pytest.raises(ConfigError) as err:
        parse_config(["--batch_size=-1", "--no_such_flag=3", "--lr_scale=cubic", "--debug=maybe"])
    keys = [p.split(":")[0] for p in err.value.problems]
    assert keys == ["batch_size", "no_such_flag", "lr_scale", "debug"]
    assert "4 problems" in err.value.render()


def test_wrong_types_and_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as err:
        parse_config(["--max_epochs=two", "--learning_rate=fast"])
    assert [p.split(":")[0] for p in err.value.problems] == ["max_epochs", "learning_rate"]
    with pytest.raises(ConfigError, match="file not found"):
        parse_config([f"--config={tmp_path / 'nope.yaml'}"])


def test_help_lists_every_field() -> None:
    text = help_text()
    for name in FIELDS:
        assert f"--{name}" in text


def test_three_problems_of_different_kinds_reported_together(tmp_path: Path) -> None:
    """A range error, a bad choice and a cross-field contradiction: one message, all three."""
    path = tmp_path / "bad.yaml"
    path.write_text("batch_size: 0\nlr_scale: cubic\nsample_period: 500\nmax_steps: 100\n")
    with pytest.raises(ConfigError) as err:
        parse_config([f"--config={path}"])
    assert [p.split(":")[0] for p in err.value.problems] == [
        "batch_size",
        "lr_scale",
        "sample_period/max_steps",
    ]
    assert err.value.render().startswith("3 problems in the configuration:")


def test_cross_check_on_a_key_that_is_already_wrong_is_skipped() -> None:
    with pytest.raises(ConfigError) as err:
        parse_config(["--max_steps=ten", "--sample_period=500"])
    assert [p.split(":")[0] for p in err.value.problems] == ["max_steps"]


def test_cross_field_checks(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as err:
        parse_config(
            ["--encoder_lr_mult=0", "--decoder_lr_mult=0",
             f"--resume_from_checkpoint={tmp_path / 'nope.ckpt'}", "--sample_period=0"]
        )  # fmt: skip
    keys = [p.split(":")[0] for p in err.value.problems]
    assert keys == ["sample_period", "encoder_lr_mult/decoder_lr_mult", "resume_from_checkpoint"]
    resume = parse_config(["--resume_from_checkpoint=last"]).checkpoints.resume_from_checkpoint
    assert resume == "last"
    with pytest.raises(ConfigError, match="overwrite/resume_from_checkpoint: overwrite deletes"):
        parse_config(["--overwrite=true", "--resume_from_checkpoint=last"])
    with pytest.raises(ConfigError) as err:  # a run of 0 epochs or 0 steps did nothing, said done
        parse_config(["--max_epochs=0", "--max_steps=0"])
    assert err.value.problems == [
        "max_epochs: 0 would train nothing; at least 1, or -1: no limit",
        "max_steps: 0 would train nothing; at least 1, or -1: no limit",
    ]


def test_resolved_config_round_trips_through_yaml(tmp_path: Path) -> None:
    """What --print_config prints and the run folder's config.yaml hold is a valid --config."""
    cfg = parse_config(["--batch_size=7", "--learning_rate=5e-5", "--lr_scale=linear",
                        "--precision=bf16-mixed", "--decoder_lr_mult=0.5"])  # fmt: skip
    path = tmp_path / "config.yaml"
    path.write_text(cfg.to_yaml())
    again = parse_config([f"--config={path}"])
    assert again.to_dict() == {**cfg.to_dict(), "config": str(path)}
    # --overwrite is an action of one launch: a saved config does not repeat it
    assert "overwrite" not in parse_config(["--overwrite=true"]).to_yaml()


@pytest.mark.parametrize("text", ["5e-5", "1E-3", "2.5e-4"])
def test_yaml_exponent_floats(tmp_path: Path, text: str) -> None:
    path = tmp_path / "c.yaml"
    path.write_text(f"learning_rate: {text}\nweight_decay: {text}\n")
    cfg = parse_config([f"--config={path}"])
    assert cfg.optim.learning_rate == cfg.optim.weight_decay == pytest.approx(float(text))


def test_print_config_prints_yaml_without_starting_anything(tmp_path: Path) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "ae.cli.launch", "--print_config", "--batch_size=3",
         f"--output_dir={tmp_path / 'run'}"],
        capture_output=True, text=True, timeout=60, cwd=Path(__file__).resolve().parent.parent,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    printed = yaml.safe_load(out.stdout)  # stdout is exactly the YAML
    expected = parse_config(["--batch_size=3", f"--output_dir={tmp_path / 'run'}"])
    assert printed == yaml.safe_load(expected.to_yaml()) and printed["batch_size"] == 3
    assert not (tmp_path / "run").exists()


def test_help_shows_one_line_descriptions() -> None:
    text = help_text()
    assert "--encoder_lr_mult" in text and "encoder LR = effective LR x this" in text
    assert "--val_interval" in text and "optimizer steps" in text


def test_pg_timeout_must_exceed_stall_timeout() -> None:
    with pytest.raises(ConfigError) as err:
        parse_config(["--stall_timeout=300", "--pg_timeout=120"])
    assert [p.split(":")[0] for p in err.value.problems] == ["pg_timeout"]
    assert parse_config(["--stall_timeout=0", "--pg_timeout=120"]).obs.pg_timeout == 120
    cfg = parse_config(["--log_rotate_mb=0.5", "--log_rotate_keep=7"])
    assert (cfg.obs.log_rotate_mb, cfg.obs.log_rotate_keep) == (0.5, 7)


def test_a_hang_timeout_without_the_watchdog_is_refused() -> None:
    """--stall_timeout=0 turns the watchdog off, and with it the hang restarts: a
    --hang_timeout asked for beside it is refused by name; the default goes quietly."""
    with pytest.raises(ConfigError) as err:
        parse_config(["--stall_timeout=0", "--hang_timeout=5"])
    assert [p.split(":")[0] for p in err.value.problems] == ["hang_timeout/stall_timeout"]
    assert "--hang_timeout=5 needs the watchdog" in err.value.problems[0]
    assert parse_config(["--stall_timeout=0"]).obs.hang_timeout == 1800
    assert parse_config(["--stall_timeout=0", "--hang_timeout=0"]).obs.stall_timeout == 0
    assert parse_config(["--stall_timeout=60", "--hang_timeout=5"]).obs.hang_timeout == 5


def test_model_flags_lists_and_mappings_from_cli_and_yaml(tmp_path: Path) -> None:
    cfg = parse_config(["--model=resnet", "--channel_mult=1,2,4", "--downsample=4",
                        "--hidden_dims", "[64, 32]", "--kl_weight=1e-3", "--loss=l1"])  # fmt: skip
    m = cfg.model
    assert (m.model, m.channel_mult, m.downsample, m.hidden_dims) == (
        "resnet",
        (1, 2, 4),
        4,
        (64, 32),
    )
    assert (m.kl_weight, m.loss, m.model_args) == (1e-3, "l1", None)
    path = tmp_path / "c.yaml"
    path.write_text(
        "model: pkg.mod:Net\nmodel_args:\n  width: 8\n  sizes: [1, 2]\nhidden_dims: 16\n"
    )
    cfg = parse_config([f"--config={path}"])
    assert cfg.model.model_args == {"width": 8, "sizes": [1, 2]} and cfg.model.hidden_dims == (16,)
    flag = parse_config(["--model=pkg.mod:Net", '--model_args={"width": 4}'])  # JSON is YAML
    assert flag.model.model_args == {"width": 4}
    with pytest.raises(ConfigError) as err:  # unclosed: the problem and where, not the context
        parse_config(["--model=pkg.mod:Net", "--model_args={width: 4"])
    assert err.value.problems == [
        "model_args: not YAML/JSON: expected ',' or '}', but got '<stream end>' at column 10 of "
        "'{width: 4'"
    ]
    # the resolved config (config.yaml, --print_config) is a valid --config again
    path.write_text(cfg.to_yaml())
    assert parse_config([f"--config={path}"]).model == cfg.model


def test_model_flag_problems_all_at_once() -> None:
    with pytest.raises(ConfigError) as err:
        parse_config(["--model=resnet:", "--model_args=[1, 2]", "--channel_mult=1,x",
                      "--hidden_dims=0,4", "--ema_decay=1", "--downsample=3"])  # fmt: skip
    assert err.value.problems == [
        "model_args: must be a mapping of names to values; got '[1, 2]'",
        "channel_mult: must be integers separated by commas; got '1,x'",
        "hidden_dims: must be >= 1; got 0,4",
        "model: must be one of auto, mlp, conv, resnet or package.module:ClassName; got 'resnet:'"
        " (did you mean resnet?)",
        "downsample: must be one of 2, 4, 8, 16; got 3",
        "ema_decay: must be below 1 (0 = off); got 1.0",
    ]
    with pytest.raises(ConfigError) as err:
        parse_config(["--model=resnet", "--downsample=16", "--model_args={a: 1}",
                      "--kl_weight=0.1"])  # fmt: skip
    assert [p.split(":")[0] for p in err.value.problems] == [
        "model_args",
        "channel_mult/downsample",
    ]
    with pytest.raises(ConfigError, match="kl_weight: only for the built-in models"):
        parse_config(["--model=my.mod:Net", "--kl_weight=0.1"])


def test_data_input_flags() -> None:
    cfg = parse_config(["--input_key=jpg;png", "--image_size=64", "--channels=1", "--random_flip",
                        "--npy_scale=0.5"]).data  # fmt: skip
    assert (cfg.input_key, cfg.image_size, cfg.channels, cfg.random_flip, cfg.npy_scale) == (
        "jpg;png",
        64,
        1,
        True,
        0.5,
    )
    with pytest.raises(ConfigError) as err:
        parse_config(["--channels=2", "--image_size=-1"])
    assert [p.split(":")[0] for p in err.value.problems] == ["image_size", "channels"]


def test_straggler_flags() -> None:
    obs = parse_config([]).obs
    assert (obs.straggler_factor, obs.straggler_window) == (1.3, 60.0)
    assert parse_config(["--straggler_factor=0"]).obs.straggler_factor == 0  # off
    with pytest.raises(ConfigError) as err:
        parse_config(["--straggler_factor=0.9", "--straggler_window=0"])
    assert [p.split(":")[0] for p in err.value.problems] == ["straggler_window", "straggler_factor"]


def test_resampled_split_needs_epoch_samples_and_only_it_takes_them() -> None:
    cfg = parse_config(["--shard_split=resampled", "--epoch_samples=1000000"])
    assert (cfg.data.shard_split, cfg.data.epoch_samples) == ("resampled", 1_000_000)
    for argv in (["--shard_split=resampled"], ["--epoch_samples=100"]):
        with pytest.raises(ConfigError, match=r"epoch_samples: .*needs --epoch_samples"):
            parse_config(argv)
    cfg = parse_config(["--count_cache=off", "--write_index=never"])
    assert (cfg.data.count_cache, cfg.data.write_index) == ("off", "never")


def test_val_shards_none_is_a_value_not_the_unset_default(tmp_path: Path) -> None:
    """`--val_shards=none` turns validation off; unset, validation is held out of the train
    shards. (`none` stays the unset word of every other optional flag.)"""
    assert parse_config(["--val_shards=none"]).data.val_shards == "none"
    assert not parse_config(["--val_shards=None"]).data.validates
    path = tmp_path / "c.yaml"
    path.write_text("val_shards: none\n")
    assert not parse_config([f"--config={path}"]).data.validates
    assert parse_config([]).data.validates and parse_config([]).data.val_shards is None
    assert parse_config(["--input_key=none"]).data.input_key is None


def test_logger_choices_and_missing_packages(monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = parse_config([])
    assert logger_names(cfg.obs.logger) == ["csv", "tensorboard"]  # the default
    with pytest.raises(ConfigError) as err:
        parse_config(["--logger=csv,neptune,csv"])
    assert err.value.problems == [
        "logger: csv is listed twice",
        "logger: unknown logger 'neptune'; choose from csv, tensorboard, wandb, mlflow",
    ]
    # A chosen logger whose package is missing names what installs it, before anything starts.
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a)
    )
    with pytest.raises(ConfigError) as err:
        parse_config(["--logger=csv,wandb"])
    assert err.value.problems == [
        "logger: wandb is not installed; install it with .venv/bin/pip install -e '.[wandb]'"
    ]


@pytest.mark.parametrize(
    "line",
    ["batch_size: [8, 16]", "latent_dim: {a: 1}", "batch_size:", "max_epochs: ''",
     "learning_rate: [0.1]", "debug: {a: 1}", "output_dir: [a, b]", "loss: [mse]",
     "hidden_dims: {a: 1}", "model_args: [1, 2]", "devices:"],
)  # fmt: skip
def test_a_yaml_value_of_the_wrong_shape_is_one_problem_naming_the_key_and_the_file(
    tmp_path: Path, line: str
) -> None:
    """A list, a mapping or nothing where a number, flag, word or mapping belongs: every type
    says which key, in which file, at which line; never a TypeError from int()."""
    path = tmp_path / "c.yaml"
    path.write_text(f"seed: 1\n{line}\n")
    with pytest.raises(ConfigError) as err:
        parse_config([f"--config={path}"])
    key = line.partition(":")[0]
    (problem,) = err.value.problems
    assert problem.startswith(f"{key}: ") and problem.endswith(f"(in {path}, line 2)"), problem


def test_a_range_problem_of_a_yaml_value_names_the_file_and_a_flag_overriding_it_does_not(
    tmp_path: Path,
) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("batch_size: 0\n")
    with pytest.raises(ConfigError) as err:
        parse_config([f"--config={path}"])
    assert err.value.problems == [f"batch_size: must be >= 1; got 0 (in {path}, line 1)"]
    with pytest.raises(ConfigError) as err:
        parse_config([f"--config={path}", "--batch_size=-2"])
    assert err.value.problems == ["batch_size: must be >= 1; got -2"]


EMPTY_PROBLEM = "empty value; give one, or leave the key out for its default"


@pytest.mark.parametrize(
    "key",
    ["train_shards", "val_shards", "output_dir", "resume_from_checkpoint", "config",
     "input_key", "count_cache", "mlflow_tracking_uri", "model", "model_args", "logger",
     "experiment", "batch_size", "learning_rate", "debug", "hidden_dims"],
)  # fmt: skip
def test_an_empty_flag_value_is_a_problem_naming_the_key_not_the_default(key: str) -> None:
    """`--train_shards=$DATA` with DATA unset must not train the demo digits: an empty value
    (or blanks) is refused for every flag, in both command-line forms."""
    for argv in ([f"--{key}="], [f"--{key}", ""], [f"--{key}=  "]):
        with pytest.raises(ConfigError) as err:
            parse_config(argv)
        assert err.value.problems == [f"{key}: {EMPTY_PROBLEM}"], argv


def test_an_empty_yaml_key_is_a_problem_and_null_is_the_unset_default(tmp_path: Path) -> None:
    """A saved config writes an unset key as `null`: that stays the default; an empty string
    is refused like an empty flag."""
    path = tmp_path / "c.yaml"
    path.write_text("train_shards: null\nval_shards:\n")
    cfg = parse_config([f"--config={path}"])
    assert (cfg.data.train_shards, cfg.data.val_shards) == (None, None)
    path.write_text("train_shards: ''\n")
    with pytest.raises(ConfigError) as err:
        parse_config([f"--config={path}"])
    assert err.value.problems == [f"train_shards: {EMPTY_PROBLEM} (in {path}, line 1)"]


def test_the_launcher_refuses_an_empty_train_shards_with_exit_2_before_any_rank(
    tmp_path: Path,
) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "ae.cli.launch", "--train_shards=",
         f"--output_dir={tmp_path / 'r'}"],
        capture_output=True, text=True, timeout=60, cwd=Path(__file__).resolve().parent.parent,
    )  # fmt: skip
    assert out.returncode == 2, out.stdout + out.stderr
    text = out.stdout + out.stderr
    assert f"train_shards: {EMPTY_PROBLEM}" in text and "Traceback" not in text
    assert not (tmp_path / "r").exists()
