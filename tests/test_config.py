"""The configuration's sources (`ae.config`): defaults, both command-line forms, YAML (its
floats and lists), the command line over YAML, the resolved config as a valid --config again
(--print_config), --help listing every flag."""

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from ae.config import FIELDS, ConfigError, help_text, parse_config


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


def test_help_lists_every_field() -> None:
    text = help_text()
    for name in FIELDS:
        assert f"--{name}" in text


def test_help_shows_one_line_descriptions() -> None:
    text = help_text()
    assert "--encoder_lr_mult" in text and "encoder LR = effective LR x this" in text
    assert "--val_interval" in text and "optimizer steps" in text


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
