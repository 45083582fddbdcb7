"""How the configuration says what is wrong (`ConfigError`): every problem at once, unknown
flags and keys with a guess, YAML errors and values of the wrong shape with their file and
line, empty values refused by name (and by the launcher, with exit code 2)."""

import subprocess
import sys
from pathlib import Path

import pytest

from ae.config import ConfigError, parse_config


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


def test_a_flag_without_its_value_is_named_and_the_next_flag_still_read(tmp_path: Path) -> None:
    """`--config --output_dir=x` said "config: file not found: --output_dir=x" (the next flag
    taken as the value); a folder given as the config file, Python's `[Errno 21]`."""
    with pytest.raises(ConfigError) as err:
        parse_config(["--config", "--batch_size=-1", "--seed"])
    assert err.value.problems == [
        "config: missing value; the next argument, --batch_size=-1, is a flag (--config=VALUE)",
        "seed: missing value (--seed=VALUE)",
        "batch_size: must be >= 1; got -1",
    ]
    with pytest.raises(ConfigError) as err:
        parse_config([f"--config={tmp_path}"])
    assert err.value.problems == [
        f"config: {tmp_path} is a folder; give a YAML file (--config=run.yaml)"
    ]


def test_a_key_given_twice_in_a_config_file_is_named_with_both_lines(tmp_path: Path) -> None:
    """PyYAML keeps the last of `batch_size: 8` ... `batch_size: 16` without a word."""
    path = tmp_path / "c.yaml"
    path.write_text("batch_size: 8\nseed: 1\nbatch_size: 16\n")
    with pytest.raises(ConfigError) as err:
        parse_config([f"--config={path}"])
    assert err.value.problems == [f"batch_size: given twice in {path} (lines 1 and 3); keep one"]


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


def test_a_path_flag_starting_with_a_tilde_is_under_home(tmp_path: Path, monkeypatch) -> None:
    """The shell leaves `--output_dir=~/runs` as it is: a run made a folder named `~` in the
    working directory (and `rm -rf ~` is how a user would clean it up)."""
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "run.yaml").write_text("val_shards: [~/v.tar, http://h/~x.tar]\n")
    cfg = parse_config([
        "--config=~/run.yaml", "--output_dir=~/runs/a",
        "--train_shards=~/a.tar::pipe:cat ~/b.tar", "--experiment=~x",
    ])  # fmt: skip
    assert cfg.run.output_dir == f"{tmp_path}/runs/a"
    assert cfg.data.train_shards == f"{tmp_path}/a.tar::pipe:cat ~/b.tar"  # a command: its shell
    assert cfg.data.val_shards == f"{tmp_path}/v.tar::http://h/~x.tar"
    assert cfg.obs.experiment == "~x"  # a name, not a path


def test_a_shard_spec_split_by_the_shell_is_refused_on_the_users_command_line() -> None:
    """`--train_shards=d/a-{000000..000002}.tar` unquoted: bash makes it three flags, and the
    run trained on the last shard alone ("1 train shards"). A rank's argv repeats the flags its
    launcher appends, the later winning: not refused there."""
    argv = [f"--train_shards=d/a-00000{i}.tar" for i in range(3)] + ["--val_shards=none"]
    with pytest.raises(ConfigError) as err:
        parse_config(argv, user=True)
    assert err.value.problems == [
        "train_shards: given 3 times (d/a-000000.tar, d/a-000001.tar and 1 more): the shell "
        "expands an unquoted {a..b} pattern into one flag per file; quote the spec "
        "(--train_shards='data/train-{000000..000099}.tar'), or join several with ::"
    ]
    assert parse_config(argv).data.train_shards == "d/a-000002.tar"
    # The same for shards served over http (the URL's colons did not make it "not plain": the
    # run trained on one shard of eight, exit 0)
    urls = [f"--train_shards=http://127.0.0.1:8000/a-00000{i}.tar" for i in range(3)]
    with pytest.raises(ConfigError) as err:
        parse_config(urls, user=True)
    assert err.value.problems[0].startswith("train_shards: given 3 times (http://127.0.0.1:8000/")
    # `--train_shards a-{0..2}.tar` (a space, not `=`): one spec word, then two strays
    words = ["--train_shards", *(f"http://h/a-00000{i}.tar" for i in range(3)), "--max_steps=5"]
    with pytest.raises(ConfigError) as err:
        parse_config(words, user=True)
    assert err.value.problems == [
        "train_shards: its value came as 3 separate arguments (http://h/a-000000.tar, "
        "http://h/a-000001.tar and 1 more): the shell expands an unquoted {a..b} pattern or glob "
        "into one word per file; quote the spec (--train_shards='data/train-{000000..000099}.tar'),"
        " or join several with ::"
    ]
    assert parse_config(["--batch_size=8", "--batch_size=16"], user=True).data.batch_size == 16
    # A spec given again on purpose (a script's defaults, then the user's): the later one wins
    for again in (["--val_shards=d/v-{0..3}.tar", "--val_shards=d/w.tar"],
                  ["--val_shards=d/v.tar", "--val_shards=d/v.tar"],
                  ["--val_shards=d/v-0.tar", "--val_shards=e/w-1.tar"]):  # fmt: skip
        assert parse_config(again, user=True).data.val_shards == again[1][len("--val_shards=") :]
