from pathlib import Path

import pytest

from ae.config import Config, ConfigError, help_text, parse_config


def test_defaults_and_cli_forms() -> None:
    cfg = parse_config(["--batch_size=8", "--num_workers", "1", "--debug"])
    assert (cfg.batch_size, cfg.num_workers, cfg.debug) == (8, 1, True)
    assert parse_config(["--debug=false"]).debug is False
    assert parse_config([]).log_every_n_train_batches == 500


@pytest.mark.parametrize("text", ["1e-4", "1E-4", "0.0001", "1.0e-4"])
def test_yaml_scientific_learning_rate_is_float(tmp_path: Path, text: str) -> None:
    path = tmp_path / "c.yaml"
    path.write_text(f"learning_rate: {text}\nbatch_size: 4\n")
    cfg = parse_config([f"--config={path}"])
    assert cfg.learning_rate == pytest.approx(0.0001)
    assert isinstance(cfg.learning_rate, float)


def test_cli_overrides_yaml(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("batch_size: 4\nseed: 3\n")
    cfg = parse_config([f"--config={path}", "--batch_size", "16"])
    assert (cfg.batch_size, cfg.seed) == (16, 3)


def test_unknown_key_in_yaml_is_named(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("batch_sise: 4\n")
    with pytest.raises(ConfigError) as err:
        parse_config([f"--config={path}"])
    assert err.value.problems == ["batch_sise: unknown key (see --help for the list)"]


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
    for name in Config.__dataclass_fields__:
        assert f"--{name}" in text


def test_pg_timeout_must_exceed_stall_timeout() -> None:
    with pytest.raises(ConfigError) as err:
        parse_config(["--stall_timeout=300", "--pg_timeout=120"])
    assert [p.split(":")[0] for p in err.value.problems] == ["pg_timeout"]
    assert parse_config(["--stall_timeout=0", "--pg_timeout=120"]).pg_timeout == 120
    cfg = parse_config(["--log_rotate_mb=0.5", "--log_rotate_keep=7"])
    assert (cfg.log_rotate_mb, cfg.log_rotate_keep) == (0.5, 7)
