"""The configuration's flags by section, and the checks between them: timeouts, the model's
flags (lists and mappings from the command line and YAML), the data's input flags, the
straggler flags, the resampled split, the loggers and their packages."""

import importlib.util
from pathlib import Path

import pytest

from ae.config import ConfigError, logger_names, parse_config


def test_cross_field_checks(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as err:
        parse_config(
            ["--encoder_lr_mult=0", "--decoder_lr_mult=0",
             f"--resume_from_checkpoint={tmp_path / 'nope.ckpt'}", "--sample_period=0"]
        )  # fmt: skip
    keys = [p.split(":")[0] for p in err.value.problems]
    assert keys == ["sample_period", "encoder_lr_mult/decoder_lr_mult", "resume_from_checkpoint"]
    assert err.value.problems[-1] == (
        f"resume_from_checkpoint: no such checkpoint file: {tmp_path / 'nope.ckpt'} (a path, or "
        "last)"
    )
    # A mistyped or pruned step checkpoint: the folder's checkpoints are named (was: none)
    for name in ("step-00000040.ckpt", "last.ckpt"):
        (tmp_path / name).write_bytes(b"x")
    with pytest.raises(ConfigError) as err:
        parse_config([f"--resume_from_checkpoint={tmp_path / 'step-00000099.ckpt'}"])
    assert err.value.problems == [
        f"resume_from_checkpoint: no such checkpoint file: {tmp_path / 'step-00000099.ckpt'} (a "
        f"path, or last); {tmp_path} holds last.ckpt, step-00000040.ckpt"
    ]
    # A run folder or its checkpoints/ (was: "no such checkpoint file" of a folder that is there)
    ckpts = tmp_path / "run" / "checkpoints"
    ckpts.mkdir(parents=True)
    for name in ("step-00000040.ckpt", "last.ckpt"):
        (ckpts / name).write_bytes(b"x")
    for folder in (ckpts.parent, ckpts):
        with pytest.raises(ConfigError) as err:
            parse_config([f"--resume_from_checkpoint={folder}"])
        assert err.value.problems == [
            f"resume_from_checkpoint: {folder} is a folder; name one of its checkpoints: "
            f"{ckpts / 'last.ckpt'}, {ckpts / 'step-00000040.ckpt'}, or last"
        ]
    # A bare name of one in the run folder (`best`, like `last`): its path (was: no such file)
    for name in ("best", "best.ckpt"):
        (ckpts / "best.ckpt").write_bytes(b"x")
        with pytest.raises(ConfigError) as err:
            parse_config([f"--output_dir={ckpts.parent}", f"--resume_from_checkpoint={name}"])
        assert err.value.problems == [
            f"resume_from_checkpoint: no such checkpoint file: {name} (a path, or last); did you "
            f"mean --resume_from_checkpoint={ckpts / 'best.ckpt'}?"
        ]
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
    path.write_text("model: mlp\nhidden_dims: 16\n")
    assert parse_config([f"--config={path}"]).model.hidden_dims == (16,)
    path.write_text("model: pkg.mod:Net\nmodel_args:\n  width: 8\n  sizes: [1, 2]\n")
    cfg = parse_config([f"--config={path}"])
    assert cfg.model.model_args == {"width": 8, "sizes": [1, 2]}
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
        "model_args: must be a mapping of names to values, e.g. '{width: 64}'; got '[1, 2]'",
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
    # the default 1,2,4,4 with --downsample=16: the flag that fits, with its value
    assert err.value.problems[1].endswith("got 1,2,4,4 (e.g. --channel_mult=1,2,4,4,4)")
    with pytest.raises(ConfigError, match="kl_weight: only for the built-in models"):
        parse_config(["--model=my.mod:Net", "--kl_weight=0.1"])


def test_a_class_of_your_own_is_given_its_arguments_in_model_args(tmp_path: Path) -> None:
    """Found by the own-model walkthrough: each of these trained the class as if not given
    (a built-in network's flag, ignored), or failed 30 s later in every rank."""
    with pytest.raises(ConfigError) as err:
        parse_config(["--model=my.mod:Net", "--latent_dim=32", "--hidden_dims=8,4", "--latent=4",
                      "--batchsize=3", "--model_args={width:64}"])  # fmt: skip
    assert err.value.problems == [
        # a flag of its own: not the built-in network's --latent_dim
        "latent: unknown flag --latent; an argument of your own class goes in "
        "--model_args='{latent: 4}' (--help lists every flag)",
        "batchsize: unknown flag --batchsize; did you mean --batch_size? (--help lists every flag)",
        # `{width:64}` is YAML for {"width:64": None}
        "model_args: 'width:64' is a name without a value: YAML needs a space after the colon "
        "({width: 64}); got '{width:64}'",
        "latent_dim: only for the built-in models (mlp, conv, resnet); your own class takes its "
        "arguments in --model_args, e.g. --model_args='{latent_dim: 32}'",
        "hidden_dims: only for the built-in models (mlp, conv, resnet); your own class takes its "
        "arguments in --model_args, e.g. --model_args='{hidden_dims: [8, 4]}'",
    ]
    config = tmp_path / "run.yaml"
    config.write_text("model: my.mod:Net\nlatent: 4\n")
    with pytest.raises(ConfigError) as err:
        parse_config([f"--config={config}"])
    assert err.value.problems == [
        f"latent: unknown key in {config}, line 2; an argument of your own class goes under "
        "model_args: (latent: 4) (--help lists every key)"
    ]
    with pytest.raises(ConfigError, match="did you mean --latent_dim"):  # a built-in model
        parse_config(["--latent=4"])
    assert parse_config(["--model=conv", "--latent_dim=32"]).model.latent_dim == 32


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


def test_logger_choices_and_missing_packages(monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = parse_config([])
    assert logger_names(cfg.obs.logger) == ["csv", "tensorboard"]  # the default
    with pytest.raises(ConfigError) as err:
        parse_config(["--logger=csv,neptune,csv"])
    assert err.value.problems == [
        "logger: csv is listed twice",
        "logger: unknown logger 'neptune'; choose from csv, tensorboard, wandb, mlflow",
    ]
    # A slip of the keys or of case names the logger meant.
    for slip, meant in (("tensorbord", "tensorboard"), ("TensorBoard", "tensorboard"),
                        ("wandbb", "wandb"), ("CSV", "csv")):  # fmt: skip
        with pytest.raises(ConfigError) as err:
            parse_config([f"--logger={slip}"])
        assert err.value.problems == [
            f"logger: unknown logger {slip!r} (did you mean {meant}?); "
            "choose from csv, tensorboard, wandb, mlflow"
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
