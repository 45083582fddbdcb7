"""ae-encode's launcher side (arguments, output names) and its checkpoint checks."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path

import numpy as np
import pytest
import torch

from ae.config import ModelConfig
from ae.data.decoding.decode import InputSpec
from ae.data.input_probe import probe_decoder
from ae.data.shards.writer import npy_bytes, png_bytes, write_shard
from ae.job.encode import (
    check_checkpoint,
    check_out_dir_outside_inputs,
    check_outputs,
    make_out_dir,
)
from ae.job.encode_args import EncodeArgsError, help_text, output_paths, parse_args
from ae.run_paths import RunDir
from ae.training.encoding import (
    EncodeError,
    input_config,
    load_checkpoint,
    model_from_checkpoint,
    probe_inputs,
)
from ae.training.model import AutoEncoder
from ae.training.position.checkpoint_read import DamagedCheckpoint, NotAnAeCheckpoint
from tests.support.encode_checkpoint import encode_checkpoint
from tests.support.runs import ROOT


def test_output_names_follow_the_input_names(tmp_path: Path) -> None:
    urls = ["/data/a/train-000001.tar", "pipe:aws s3 cp s3://b/x/val-000002.tar -",
            "https://h/p/shard-7.tar?sig=1", "pipe:make-a-shard"]  # fmt: skip
    assert [p.name for p in output_paths(urls, tmp_path)] == [
        "train-000001.tar", "val-000002.tar", "shard-7.tar", "shard-000003.tar"]  # fmt: skip
    with pytest.raises(EncodeArgsError) as err:
        urls = ["/a/train-0.tar", "/b/train-0.tar", "/a/train-1.tar", "/b/train-1.tar"]
        check_outputs(urls, output_paths(urls, tmp_path))
    assert err.value.render() == (  # one line, not one per pair
        "SPEC: input shards of one file name would both be written to one output: "
        f"/a/train-0.tar and /b/train-0.tar -> {tmp_path}/train-0.tar (and 1 more pairs); "
        "encode each set into its own folder"
    )
    shard = tmp_path / "in.tar"
    shard.write_bytes(b"")
    with pytest.raises(EncodeArgsError) as err:
        check_outputs([str(shard)], output_paths([str(shard)], tmp_path))
    assert err.value.render() == (
        f"OUT_DIR: {tmp_path} holds the input shards: the outputs would overwrite {shard}; "
        "encode into another folder"
    )
    # OUT_DIR the input folder of 50 shards: one line, not one per shard (five, cut there)
    urls = [str(tmp_path / f"train-{i:06d}.tar") for i in range(50)]
    with pytest.raises(EncodeArgsError) as err:
        check_outputs(urls, output_paths(urls, tmp_path))
    assert err.value.render() == (
        f"OUT_DIR: {tmp_path} holds the input shards: the outputs would overwrite {urls[0]} and "
        "49 more; encode into another folder"
    )


def test_an_out_dir_holding_shards_of_the_output_names_is_refused_without_overwrite(
    tmp_path: Path,
) -> None:
    """`ae-encode CKPT other/ data/emb` where data/emb holds a dataset of the same shard names:
    its shards were replaced by latents, silently; now refused unless --overwrite."""
    (tmp_path / "in").mkdir()
    (tmp_path / "out").mkdir()
    urls = [str(tmp_path / "in" / f"train-00000{i}.tar") for i in range(5)]
    outs = output_paths(urls, tmp_path / "out")
    for out in outs[:4]:
        out.write_bytes(b"someone's data")
    with pytest.raises(EncodeArgsError) as err:
        check_outputs(urls, outs)
    assert err.value.render() == (
        f"OUT_DIR: {tmp_path / 'out'} already holds 4 of the 5 output shards (train-000000.tar, "
        "train-000001.tar, train-000002.tar, ...) and no encoding.json there says which "
        "ae-encode wrote them (another dataset, or an ae-encode older than this one); encode "
        "into another folder, or pass --overwrite to replace them"
    )
    check_outputs(urls, outs, overwrite=True)
    assert parse_args([__file__, "s", "o", "--overwrite"]).overwrite


def test_argument_problems_all_at_once(tmp_path: Path) -> None:
    with pytest.raises(EncodeArgsError) as err:
        parse_args([str(tmp_path / "no.ckpt"), "x", "out", "--batch_size=0", "--field=latent",
                    "--devices=two", "--keep_fields=cls,latent"])  # fmt: skip
    assert [line.split(":")[0] for line in err.value.render().splitlines()] == [
        "CKPT", "batch_size", "field", "keep_fields", "devices"]  # fmt: skip
    with pytest.raises(EncodeArgsError, match=r"keep_fields: names the output field x\.npy"):
        parse_args([__file__, "s", "o", "--field=x.npy", "--keep_fields=cls,x.npy"])
    args = parse_args([__file__, "s", "o", "--keep_fields= cls, json ,", "--dtype=float16"])
    assert args.keep == frozenset({"cls", "json"}) and args.dtype == "float16"


def test_bad_arguments_fail_in_the_launcher_without_ranks(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "ae.cli.encode", str(tmp_path / "x.ckpt"),
         f"{tmp_path}/none-*.tar", str(tmp_path / "out"), "--dtype=float64"],
        cwd=ROOT, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert proc.returncode == 2 and "float64" in proc.stderr + proc.stdout
    assert "Traceback" not in proc.stderr and not (tmp_path / "out").exists()


def test_out_dir_the_input_folder_is_said_before_the_checkpoint_is_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, said: list[str]
) -> None:
    """The output names are checked first, in no time; the checkpoint check (torch, in a
    process of its own) and its hash after."""
    from ae.job import encode as job_encode

    write_shard(tmp_path / "train-000000.tar", [{"__key__": b"0", "npy": npy_bytes(np.ones(2))}])
    (tmp_path / "m.ckpt").write_bytes(b"")
    monkeypatch.setattr(job_encode, "check_checkpoint", lambda args: pytest.fail("read"))
    assert job_encode.launch([str(tmp_path / "m.ckpt"), str(tmp_path), str(tmp_path)]) == 2
    assert said[-1].startswith(f"OUT_DIR: {tmp_path} holds the input shards")


def test_a_spec_the_shell_split_into_files_is_named(tmp_path: Path) -> None:
    """`ae-encode CKPT data/train-{000000..000002}.tar OUT`, unquoted: the shell passed three
    files, the second read as OUT_DIR, and the message was `unrecognized arguments: OUT`."""
    files = [f"data/train-{i:06d}.tar" for i in range(3)]
    with pytest.raises(EncodeArgsError) as err:
        parse_args([__file__, *files, str(tmp_path / "out")])
    assert err.value.render().startswith(
        "SPEC: several shard files came as separate arguments (data/train-000000.tar, "
        "data/train-000001.tar and 1 more): the shell expanded an unquoted pattern; quote it "
        "('data/train-{000000..000002}.tar')"  # the files' own pattern, not an example's
    )
    with pytest.raises(EncodeArgsError, match=r"^unrecognized arguments: --bogus \(see ae-enc"):
        parse_args([__file__, files[0], str(tmp_path / "out"), "--bogus"])


def test_an_out_dir_that_cannot_be_made_is_one_message(tmp_path: Path) -> None:
    """OUT_DIR a file: torchrun's start raised NotADirectoryError, a traceback."""
    taken = tmp_path / "notes.txt"
    taken.write_text("mine")
    with pytest.raises(EncodeArgsError) as err:
        make_out_dir(parse_args([__file__, "s", str(taken)]))
    assert err.value.render() == (
        f"OUT_DIR: {taken} cannot be written (Not a directory: {taken / 'logs'}); encode into a "
        "folder you can write"
    )
    assert taken.read_text() == "mine"


def test_the_model_is_rebuilt_from_the_checkpoint(tmp_path: Path) -> None:
    spec = InputSpec("vector", (10,))
    ckpt = load_checkpoint(encode_checkpoint(tmp_path, spec))
    model, latent = model_from_checkpoint(ckpt, spec, "m.ckpt")
    assert latent == (3,) and not model.training
    x = torch.rand(2, 10)
    reference = AutoEncoder(spec, ModelConfig(hidden_dim=16, latent_dim=3))
    reference.load_state_dict(ckpt["state_dict"])
    assert torch.equal(model.encode(x), reference.encode(x))
    with pytest.raises(EncodeError, match=r"samples have shape \(12,\), but m\.ckpt was trained"):
        model_from_checkpoint(ckpt, InputSpec("vector", (12,)), "m.ckpt")


def test_images_are_decoded_with_the_channels_the_model_was_trained_on(tmp_path: Path) -> None:
    """A colour-trained run (`--channels=0`: from its first image) encoding shards whose first
    image is grayscale: was `SPEC: samples have shape (1, 8, 8), but m.ckpt was trained on (3, 8,
    8)`; their images are taken to RGB, as the run took its own."""
    ckpt = load_checkpoint(encode_checkpoint(tmp_path, InputSpec("image", (3, 8, 8))))
    gray_first = [
        {"__key__": f"{i}".encode(), "png": png_bytes(np.full((8, 8) if i == 0 else (8, 8, 3), i,
                                                              np.uint8))}
        for i in range(3)
    ]  # fmt: skip
    write_shard(tmp_path / "in.tar", gray_first)
    cfg = input_config(ckpt)
    assert cfg.channels == 3
    decoder = probe_decoder("input", [str(tmp_path / "in.tar")], cfg)
    assert decoder.spec == InputSpec("image", (3, 8, 8))
    model_from_checkpoint(ckpt, decoder.spec, "m.ckpt")  # no shape error


def test_arrays_for_a_model_trained_on_images_are_named_against_what_it_saw(
    tmp_path: Path,
) -> None:
    """Latents (arrays) given to an image model's checkpoint: the rank said "--channels applies
    to images; the input field latent.npy is an array (leave it unset)", of a flag ae-encode
    does not have (the training run's, recorded in the checkpoint)."""
    ckpt = load_checkpoint(encode_checkpoint(tmp_path, InputSpec("image", (1, 8, 8))))
    ckpt["ae_config"]["channels"] = 1
    write_shard(tmp_path / "in.tar", [{"__key__": b"0", "latent.npy": npy_bytes(np.ones(4))}])
    with pytest.raises(EncodeError) as err:
        probe_inputs(ckpt, [str(tmp_path / "in.tar")], "m.ckpt")
    assert err.value.render() == (
        "SPEC: these shards do not decode as the data m.ckpt was trained on (images of shape "
        "1x8x8), by the settings its run recorded: --channels applies to images; the input "
        "field latent.npy is an array (leave it unset)"
    )


def test_a_file_that_is_no_ae_checkpoint_is_named(tmp_path: Path) -> None:
    junk = tmp_path / "junk.ckpt"
    junk.write_bytes(b"not a checkpoint")
    # Not an archive at all: the safe reader names it damaged (a UserError, no traceback).
    with pytest.raises(DamagedCheckpoint, match=r"junk\.ckpt: .*damaged \(truncated or not a chec"):
        load_checkpoint(junk)
    torch.save({"state_dict": {}}, junk)
    with pytest.raises(NotAnAeCheckpoint, match="not a checkpoint written by ae"):
        load_checkpoint(junk)


def test_a_run_folder_as_ckpt_names_its_checkpoints(tmp_path: Path) -> None:
    """It said "no such checkpoint file: runs/ae" of a folder that is there."""
    (tmp_path / "run" / "checkpoints").mkdir(parents=True)
    (tmp_path / "run" / "checkpoints" / "last.ckpt").write_bytes(b"")
    for ckpt in (tmp_path / "run", tmp_path / "run" / "checkpoints"):
        with pytest.raises(EncodeArgsError) as err:
            parse_args([str(ckpt), "in.tar", str(tmp_path / "out")])
        assert err.value.render() == (
            f"CKPT: {ckpt} is a folder; name one of its checkpoints: "
            f"{tmp_path / 'run' / 'checkpoints' / 'last.ckpt'}"
        )


def test_an_out_dir_inside_the_input_folder_is_refused(tmp_path: Path) -> None:
    """`ae-encode CKPT data data/latents` ran; run again it took data/latents/*.tar for inputs
    and refused with a line per shard that two inputs had one output name."""
    (tmp_path / "data" / "latents").mkdir(parents=True)
    with pytest.raises(EncodeArgsError) as err:
        check_out_dir_outside_inputs(f"x.tar::{tmp_path / 'data'}", tmp_path / "data" / "latents")
    assert err.value.render().startswith(
        f"OUT_DIR: {tmp_path / 'data' / 'latents'} is inside the input folder {tmp_path / 'data'}"
    )
    check_out_dir_outside_inputs(str(tmp_path / "data"), tmp_path / "latents")  # beside: fine
    check_out_dir_outside_inputs(f"{tmp_path}/data/*.tar", tmp_path / "data" / "latents")
    check_out_dir_outside_inputs(str(tmp_path / "data"), tmp_path / "data")  # check_outputs


def test_a_training_runs_folder_is_no_out_dir(tmp_path: Path) -> None:
    ckpt = encode_checkpoint(tmp_path, InputSpec("vector", (12,)))
    (tmp_path / "run" / "checkpoints").mkdir(parents=True)
    with pytest.raises(EncodeArgsError, match=r"OUT_DIR: \S+run holds a training run; encode"):
        parse_args([str(ckpt), "in.tar", str(tmp_path / "run")])


def test_one_encode_per_out_dir_and_a_training_run_kept_out(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, said: list[str]
) -> None:
    """Two ae-encodes into one OUT_DIR both ran (the second with another checkpoint would mix
    its latents with the first's). Now the first holds OUT_DIR's lock while its ranks run: a
    second is refused by name, and so is a training run; the lock goes with the job, and a lock
    left by a killed ae-encode does not make the folder a training run's."""
    from ae.job import encode as job_encode
    from ae.job.folder_lock import RunFolderBusy, acquire, read_lock

    ckpt = encode_checkpoint(tmp_path, InputSpec("vector", (12,)))
    (tmp_path / "in.tar").write_bytes(b"")  # read by the ranks alone, which do not run here
    out = tmp_path / "out"
    argv = [str(ckpt), str(tmp_path / "in.tar"), str(out), "--devices=1"]
    run_dir = RunDir(out)
    seen: dict[str, object] = {}

    def ranks_run(*args: object, keep_fds: tuple[int, ...] = (), **kwargs: object):
        if "holder" in seen:  # the second ae-encode's ranks, had it been let in
            return 0, None
        seen["holder"] = read_lock(run_dir.lock)
        seen["keep_fds"] = keep_fds
        seen["second"] = job_encode.launch([*argv[:-1], "--devices=2"])
        with pytest.raises(RunFolderBusy) as err:
            acquire(run_dir, "local job", "20261128_101500")
        seen["training"] = err.value.render()
        return 0, None

    monkeypatch.setattr(job_encode, "run_ranks", ranks_run)
    monkeypatch.setattr(
        job_encode, "check_checkpoint", lambda args: None
    )  # a process: tested above
    assert job_encode.launch(argv) == 0
    holder = seen["holder"]
    assert holder is not None and holder.kind == "encoding" and seen["keep_fds"]
    assert seen["second"] == 2
    busy = next(line for line in said if "is in use by another run" in line)
    assert f"{out} is in use by another run: ae-encode, local job (pid {os.getpid()}" in busy
    assert "encode into another OUT_DIR" in busy
    assert "ae-encode, local job" in str(seen["training"])
    assert "train into another --output_dir" in str(seen["training"])
    assert not run_dir.lock.exists()  # released with the job
    # A lock file left by a killed ae-encode: stale, taken over, not a training run's folder
    run_dir.lock.write_text(json.dumps({**asdict(holder), "pid": 2**22 + 1}))
    assert job_encode.launch([*argv, "--overwrite"]) == 0


def test_the_launcher_refuses_what_the_ranks_could_not_read(tmp_path: Path) -> None:
    """Checked before any rank starts, with the ranks' own message (one exit 2 for the job,
    not a rank's failure reported late)."""
    junk, spec = tmp_path / "junk.ckpt", str(tmp_path / "in.tar")
    junk.write_bytes(b"garbage")
    with pytest.raises(EncodeArgsError, match=r"junk\.ckpt: the checkpoint file is damaged"):
        check_checkpoint(parse_args([str(junk), spec, str(tmp_path / "out")]))
    torch.save({"state_dict": {}}, junk)
    with pytest.raises(EncodeArgsError, match=r"junk\.ckpt: not a checkpoint written by ae"):
        check_checkpoint(parse_args([str(junk), spec, str(tmp_path / "out")]))
    good = encode_checkpoint(tmp_path, InputSpec("vector", (12,)))
    check_checkpoint(parse_args([str(good), spec, str(tmp_path / "o")]))  # passes
    # Trained with a class of the user's, encoded from another folder: each rank failed to
    # import it, 40 s after starting (found by the own-model walkthrough); now said here
    state = torch.load(good, weights_only=True)
    state["ae_config"]["model"] = "my_models_xyz:Net"
    torch.save(state, junk)
    with pytest.raises(EncodeArgsError) as err:
        check_checkpoint(parse_args([str(junk), spec, str(tmp_path / "out")]))
    assert err.value.render() == (
        f"{junk}: its model is your own class my_models_xyz:Net, which cannot be found from here: "
        f"no module 'my_models_xyz' (looked in the working directory {os.getcwd()} and on "
        "PYTHONPATH); run from the folder its training ran in, or put the folder holding the "
        "module on PYTHONPATH"
    )


@pytest.mark.parametrize("module", ["ae.cli.encode", "ae.cli.launch", "ae.cli.rank_process"])
def test_help_is_text_without_a_clock(module: str) -> None:
    out = subprocess.run(
        [sys.executable, "-m", module, "--help"], cwd=ROOT, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr
    first = out.stdout.splitlines()[0]
    assert not re.match(r"\d\d:\d\d:\d\d", first), first
    assert "--batch_size" in out.stdout


def test_every_ae_encode_flag_is_described() -> None:
    lines = help_text().splitlines()
    for i, line in enumerate(lines):
        if m := re.match(r"  (--\w+)( [A-Z_{},0-9a-z]+)?$", line):  # the description wraps below
            assert lines[i + 1].startswith(" " * 10), f"{m[1]} has no description"
        elif m := re.match(r"  (--\w+)", line):
            assert re.match(r"  --\w+( \S+)?  +\S", line), f"{m[1]} has no description"


def test_ranks_that_failed_are_reported_by_their_own_words(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, said: list[str]
) -> None:
    """ae-encode ends as training does: the ranks' diagnosis (a user error: its one message and
    exit 2), not torchrun's exit 1. The ranks are synthetic logs, written where torchrun would
    have run them."""
    from ae.job import encode as job_encode
    from bench.synthetic_logs import TS, RankWriter, write_train_log

    ckpt = encode_checkpoint(tmp_path, InputSpec("vector", (12,)))
    (shard := tmp_path / "in.tar").write_bytes(b"")
    out = tmp_path / "out"
    monkeypatch.setenv("AE_RUN_TS", TS)

    def ranks_fail(*args, **kwargs) -> tuple[int, None]:
        logs = out / "logs"
        write_train_log(logs, 2)
        for rank in (0, 1):
            w = RankWriter(logs, rank, 2)
            w.start()
            w.log(f"SPEC: samples have shape (16,), but {ckpt} was trained on (12,)", "ERROR")
            w.exit(2, "EncodeError")
            w.flush()
        return 1, None

    monkeypatch.setattr(job_encode, "run_ranks", ranks_fail)
    assert job_encode.launch([str(ckpt), str(shard), str(out), "--devices=2"]) == 2
    assert not any("Encoding failed" in line for line in said), said  # one message, said by rank 0
