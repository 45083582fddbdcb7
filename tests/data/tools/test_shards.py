"""`ae-shards write / index / inspect` on real files."""

from __future__ import annotations

import io
import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import webdataset as wds
from PIL import Image

from ae.cli.shards import main
from ae.data.shards.index import read_index
from ae.data.shards.tar_header_count import scan_shard
from ae.data.shards.tar_samples import iter_samples
from ae.data.shards.writer import write_shards
from tests.support.runs import ROOT


def _npy(tmp_path: Path, rows: int = 25, dim: int = 6) -> Path:
    src = tmp_path / "x.npy"
    np.save(src, np.arange(rows * dim, dtype=np.float32).reshape(rows, dim))
    return src


def test_write_npy_gives_indexed_shards_that_round_trip(tmp_path: Path, capsys) -> None:
    out = tmp_path / "out"
    assert main(["write", str(_npy(tmp_path)), str(out), "--per_shard", "10"]) == 0
    shards = sorted(out.glob("train-*.tar"))
    assert [read_index(str(p)).samples for p in shards] == [10, 10, 5]
    sample = list(iter_samples(str(shards[2])))[-1]
    assert sample["__key__"] == "00000024"
    assert np.load(io.BytesIO(sample["npy"])).tolist() == list(range(144, 150))
    assert "train-{000000..000002}.tar" in capsys.readouterr().out


def test_write_refuses_arrays_no_run_can_train_on(tmp_path: Path, capsys) -> None:
    for name, array, said in (
        ("c.npy", np.zeros((4, 3), np.complex64), "holds complex64 values; a sample must be real"),
        ("s.npy", np.array([["ab", "c"]] * 4), "holds <U2 values; a sample must be real"),
        ("one.npy", np.zeros(32, np.float32), "a 1-D array of 32 values would be 32 samples"),
    ):
        np.save(tmp_path / name, array)
        assert main(["write", str(tmp_path / name), str(tmp_path / f"o-{name}")]) == 2
        assert said in capsys.readouterr().err
        assert not (tmp_path / f"o-{name}").exists()  # nothing written


def test_write_npz_needs_key_when_ambiguous(tmp_path: Path) -> None:
    src = tmp_path / "x.npz"
    np.savez(src, a=np.zeros((3, 2)), b=np.ones((4, 2)))
    assert main(["write", str(src), str(tmp_path / "o1")]) == 2
    assert main(["write", str(src), str(tmp_path / "o2"), "--key", "b", "--prefix", "b"]) == 0
    assert read_index(str(tmp_path / "o2" / "b-000000.tar")).samples == 4


def test_image_folder_leaves_out_and_names_what_cannot_train(tmp_path: Path, capsys) -> None:
    src = tmp_path / "imgs"
    (src / "sub").mkdir(parents=True)
    for i in range(4):
        Image.fromarray(np.full((8, 8), i * 40, np.uint8)).save(src / "sub" / f"{i}.png")
    good = (src / "sub" / "0.png").read_bytes()
    (src / "broken.png").write_bytes(b"not a png")
    (src / "cut.png").write_bytes(good[: len(good) // 2])  # a truncated copy
    (src / "notes.txt").write_text("hello")
    (src / ".DS_Store").write_bytes(b"\0")
    out = tmp_path / "out"
    assert main(["write", str(src), str(out), "--per_shard", "3"]) == 0
    text = capsys.readouterr().out
    # what the file is, not Pillow's "cannot identify image file <_io.BytesIO object at 0x..>"
    assert (
        f"skipped {src / 'broken.png'}: cannot decode: UnidentifiedImageError: not an image in "
        "any format Pillow reads (9 bytes: damaged, or another kind of file under an image "
        "extension)"
    ) in " ".join(text.split())
    assert "BytesIO" not in text
    assert f"skipped {src / 'cut.png'}: cannot decode" in text
    assert "left out 2 files that are not images ((no extension), .txt)" in text
    assert "Wrote 4 samples into 2 shards" in text
    paths = [s["path"] for p in sorted(out.glob("*.tar")) for s in iter_samples(str(p))]
    assert paths == [f"sub/{i}.png".encode() for i in range(4)]
    # Nothing to train on: one message, nothing written
    (nothing := tmp_path / "nothing").mkdir()
    (nothing / "a.jpg").write_bytes(b"\xff\xd8\xff garbage")
    assert main(["write", str(nothing), str(tmp_path / "o2")]) == 2
    assert not (tmp_path / "o2").exists()


def test_inspect_finds_a_bad_image_in_shards(tmp_path: Path, capsys) -> None:
    png = io.BytesIO()
    Image.fromarray(np.zeros((8, 8), np.uint8)).save(png, format="png")
    out = tmp_path / "out"
    out.mkdir()
    samples = [{"__key__": f"{i:08d}".encode(), "png": b"not a png" if i == 0 else png.getvalue()}
               for i in range(5)]  # fmt: skip
    write_shards(out, "train", samples, per_shard=3)
    assert main(["inspect", str(out), "--json"]) == 1  # damage found
    reports = json.loads(capsys.readouterr().out)
    assert [r["samples"] for r in reports] == [3, 2] and reports[0]["index"] == "ok"
    assert reports[0]["bad"][0][0] == "00000000"
    assert "cannot decode .png" in reports[0]["bad"][0][1]
    assert set(reports[0]["fields"]) == {"png"}


def test_index_rebuilds_missing_and_reports_truncated(tmp_path: Path, capsys) -> None:
    out = tmp_path / "out"
    main(["write", str(_npy(tmp_path)), str(out), "--per_shard", "10"])
    for idx in out.glob("*.idx"):
        idx.unlink()
    damaged = out / "train-000001.tar"
    damaged.write_bytes(damaged.read_bytes()[:3000])
    assert main(["index", str(out), "--jobs", "2"]) == 1  # one shard could not be indexed
    index = read_index(str(out / "train-000000.tar"), with_offsets=True)
    assert (
        index.samples == 10 and index.offsets == scan_shard(str(out / "train-000000.tar")).offsets
    )
    assert read_index(str(damaged)) is None
    assert "2 indexed, 0 already had a current index, 1 damaged" in capsys.readouterr().out
    assert main(["inspect", str(out / "train-000001.tar")]) == 1
    assert "unreadable after" in capsys.readouterr().out


def _npy_shards(tmp_path: Path) -> Path:
    out = tmp_path / "npy-shards"
    main(["write", str(_npy(tmp_path)), str(out)])
    return out


def test_write_names_an_output_that_is_a_file_and_a_key_for_a_npy(tmp_path: Path, capsys) -> None:
    """An OUT_DIR that is a file said Python's "[Errno 17] File exists: ..."; `--key` given for
    a .npy (one array) was ignored without a word."""
    src, taken = tmp_path / "x.npy", tmp_path / "notes.txt"
    np.save(src, np.zeros((4, 3), np.float32))
    taken.write_text("mine")
    assert main(["write", str(src), str(taken)]) == 2
    assert f"{taken}: a file, not a folder; give a folder for the shards" in capsys.readouterr().err
    assert taken.read_text() == "mine"
    assert main(["write", str(src), str(tmp_path / "o"), "--key", "b"]) == 2
    assert f"--key picks an array of a .npz file; {src} is not one" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def test_bad_input_is_one_line_without_traceback(tmp_path: Path, capfd) -> None:
    """The first case through `python -m ae.cli.shards` (a real process's exit code and stderr),
    the others through `main` here, which is all that process runs (`sys.exit(main())`): an
    interpreter each was ~0.7 s of CPU. Here an uncaught exception would fail the test itself."""
    first = ["write", str(tmp_path / "missing.npy"), str(tmp_path / "o")]
    res = subprocess.run(
        [sys.executable, "-m", "ae.cli.shards", *first], cwd=ROOT, capture_output=True, text=True
    )
    assert res.returncode == 2, res
    assert "Traceback" not in res.stderr and res.stderr.count("\n") == 1, res.stderr
    npy_shards = _npy_shards(tmp_path)
    capfd.readouterr()
    for args in (
        ["inspect", str(tmp_path / "none-*.tar")],
        ["index", "pipe:cat a.tar"],
        ["index", str(tmp_path), "--jobs", "0"],
        ["inspect", str(npy_shards), "--input_key", "cls"],  # no decoder for cls
    ):
        assert main(args) == 2, args
        err = capfd.readouterr().err
        assert "Traceback" not in err and err.count("\n") == 1, (args, err)


def test_inspect_photos_reports_sizes_modes_and_the_flags_a_run_needs(
    tmp_path: Path, real_photos: list[Path], capsys
) -> None:
    src = tmp_path / "photos"
    src.mkdir()
    for p in real_photos:
        (src / p.name).write_bytes(p.read_bytes())
    out = tmp_path / "out"
    assert main(["write", str(src), str(out), "--per_shard", "20"]) == 0
    capsys.readouterr()
    assert main(["inspect", str(out)]) == 0  # every photo decodes, whatever its size and mode
    text = " ".join(capsys.readouterr().out.split())  # rich wraps long lines
    assert "input field: png or another image extension (the default" in text
    sizes = (
        r"images of (\d+) sizes \(17x23 \.\. 1411x1411; shorter side 17\.\.1411 px, median \d+\)"
    )
    assert re.search(sizes + ": pass --image_size", text)
    assert "all converted to RGB (3 channels, as the first image); --channels=1" in text
    assert main(["inspect", str(out), "--json"]) == 0
    reports = json.loads(capsys.readouterr().out)
    modes = {m for r in reports for m in r["image_modes"]}
    assert {"L", "LA", "RGB", "RGBA", "P", "CMYK", "I;16"} <= modes
    sizes = {s for r in reports for s in r["image_sizes"]}
    assert len(sizes) > 15 and "17x23" in sizes
    kinds = {k for r in reports for t in r["field_types"].values() for k in t}
    assert {"JPEG image", "PNG image", "WEBP image", "GIF image", "bytes"} <= kinds


def test_inspect_integer_arrays_suggests_a_scale(tmp_path: Path, capsys) -> None:
    src = tmp_path / "u8.npy"
    np.save(src, np.arange(60, dtype=np.uint8).reshape(10, 6))
    main(["write", str(src), str(tmp_path / "out")])
    capsys.readouterr()
    assert main(["inspect", str(tmp_path / "out"), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)[0]["field_types"]["npy"] == {"npy uint8 (6,)": 10}
    assert main(["inspect", str(tmp_path / "out")]) == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "vectors of 6 values" in text and "integer arrays (uint8)" in text
    assert "--npy_scale=0.00392156863" in text


def test_a_failing_pipe_is_named_plainly_by_bench_and_inspect(tmp_path: Path, capfd) -> None:
    """`pipe:cat` of a mistyped path: bench names the command and its exit (was WebDataset's
    `(('cat ...',), {'shell': True, ...}): exit 1 (read) {}`), and inspect says nothing could
    be read (was a hint to pick the field with --input_key). Through `main`, what
    `python -m ae.cli.shards` runs; capfd holds what `cat` and any worker write to the fds too."""
    spec = f"pipe:cat {tmp_path}/trian-000000.tar"
    assert main(["bench", spec]) == 2
    err = capfd.readouterr().err
    assert f"the command `cat {tmp_path}/trian-000000.tar` exited 1" in err, err
    assert "shell" not in err and "Traceback" not in err
    main(["inspect", spec])
    out = capfd.readouterr().out
    assert "no sample could be read" in out, out
    assert "--input_key" not in out


def test_shard_files_the_shell_split_out_of_a_pattern_are_named(tmp_path: Path, capfd) -> None:
    """`ae-shards inspect data/train-{000000..000002}.tar`, unquoted: argparse's usage and
    `unrecognized arguments: data/train-000001.tar ...`; now what happened, and to quote it.
    Through `main`, what `python -m ae.cli.shards` runs."""
    files = [str(tmp_path / f"train-{i:06d}.tar") for i in range(3)]
    assert main(["inspect", *files]) == 2
    err = capfd.readouterr().err
    assert "ae-shards inspect: SPEC: several shard files came as separate arguments" in err
    assert "usage:" not in err and err.count("\n") == 1, err
    with pytest.raises(SystemExit) as other:  # argparse's own exit
        main(["inspect", files[0], "stray"])
    assert other.value.code == 2 and "unrecognized arguments: stray" in capfd.readouterr().err


def test_bench_times_the_training_pipeline_and_names_its_path(tmp_path: Path, capsys) -> None:
    vectors, photos = tmp_path / "vectors", tmp_path / "photos"
    main(["write", str(_npy(tmp_path, rows=400, dim=8)), str(vectors), "--per_shard", "100"])
    args = ["--batch_size", "16", "--num_workers", "0", "--seconds", "0.3", "--json"]
    capsys.readouterr()
    assert main(["bench", str(vectors), *args]) == 0
    result = json.loads(capsys.readouterr().out)
    assert {"samples_per_s", "shard_mb_per_s", "first_batch_s", "read_limit_mb_per_s"} <= set(
        result
    )
    assert result["path"] == "columnar" and result["samples"] == 400
    assert result["samples_per_s"] > 0 and result["batches"] >= 1
    assert result["shard_mb_per_s"] > 0 and result["read_limit_mb_per_s"] > 0
    # images: the general path; with the run's own flag for them, and its checks
    (src := tmp_path / "imgs").mkdir()
    for i in range(40):
        Image.fromarray(np.full((12, 10), i, np.uint8)).save(src / f"{i:02d}.png")
    main(["write", str(src), str(photos), "--per_shard", "20"])
    capsys.readouterr()
    assert main(["bench", str(photos), *args, "--image_size", "8"]) == 0
    assert json.loads(capsys.readouterr().out)["path"] == "general"
    assert main(["bench", str(vectors), *args, "--image_size", "8"]) == 2  # a user error
    # Too few samples for a batch: named as the command's SPEC (not a run's train_shards), with
    # the remedies bench itself takes; --shard_split=pad fills the batch
    one = str(vectors / "train-000000.tar")
    capsys.readouterr()
    assert main(["bench", one, *args[:-1], "--batch_size", "128"]) == 2
    assert capsys.readouterr().err.endswith(
        " ae-shards bench: SPEC: 100 samples cannot fill one batch of 128 per rank on 1 rank; "
        "lower --batch_size, or use --shard_split=pad\n"
    )
    assert main(["bench", one, *args, "--batch_size", "128", "--shard_split", "pad"]) == 0
    assert json.loads(capsys.readouterr().out)["samples"] == 100
    assert main(["bench", str(tmp_path / "nothing-*.tar"), *args]) == 2
    out = capsys.readouterr().out
    assert main(["bench", str(vectors), "--seconds", "0.3", "--batch_size", "16"]) == 0
    text = capsys.readouterr().out
    assert "samples/s" in text and "columnar path" in text and "storage limit" in text
    assert out == ""  # errors went to the log, not to the JSON on stdout


def test_write_says_one_shard_and_inspect_shows_cls_as_an_integer_class(
    tmp_path: Path, capsys
) -> None:
    out = tmp_path / "out"
    assert main(["write", str(_npy(tmp_path, rows=18)), str(out)]) == 0
    assert "Wrote 18 samples into 1 shard (" in capsys.readouterr().out
    with wds.TarWriter(str(tmp_path / "w.tar")) as w:
        for i in range(3):
            w.write({"__key__": f"{i:04d}", "cls": i, "x.npy": np.zeros(2, np.float32)})
    assert main(["inspect", str(tmp_path / "w.tar"), "--json"]) == 0
    (report,) = json.loads(capsys.readouterr().out)
    assert report["field_types"]["cls"] == {"int class": 3}


def test_write_gz_gives_smaller_webdataset_shards_that_ae_counts_and_reads(
    tmp_path: Path, capsys
) -> None:
    src = _npy(tmp_path, rows=300, dim=16)
    plain, gz = tmp_path / "plain", tmp_path / "gz"
    assert main(["write", str(src), str(plain), "--per_shard", "100"]) == 0
    assert main(["write", str(src), str(gz), "--per_shard", "100", "--compress", "gz"]) == 0
    assert "train-{000000..000002}.tar.gz" in capsys.readouterr().out
    shards = sorted(gz.glob("train-*.tar.gz"))
    assert len(shards) == 3 and not list(gz.glob("*.tar"))
    assert all(p.read_bytes()[:2] == b"\x1f\x8b" for p in shards)  # gzip, by its magic
    # the bytes that matter for a remote source: tar headers and padding compress away
    plain_bytes = sum(p.stat().st_size for p in plain.glob("*.tar"))
    assert sum(p.stat().st_size for p in shards) * 3 < plain_bytes
    # counted from the sidecars, without offsets (no seeking into a gzip stream)
    index = read_index(str(shards[0]), with_offsets=True)
    assert index.samples == 100 and index.offsets is None
    # the same samples as the plain shards, through ae's reader and WebDataset's own
    ours = [s["npy"] for p in shards for s in iter_samples(str(p))]
    assert ours == [s["npy"] for p in sorted(plain.glob("*.tar")) for s in iter_samples(str(p))]
    theirs = [s["npy"] for s in wds.WebDataset([str(p) for p in shards], shardshuffle=False)]
    assert theirs == ours and len(ours) == 300
    # and the training input pipeline reads them all (the general path: compressed)
    args = ["--batch_size", "20", "--num_workers", "0", "--seconds", "5", "--json"]
    assert main(["bench", str(gz), *args]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["path"] == "general" and result["samples"] == 300
    assert main(["write", str(src), str(gz), "--compress", "gz"]) == 2  # shards already there


def test_write_and_inspect_say_a_grayscale_first_photo_trains_colour_ones_gray(
    tmp_path: Path, capsys
) -> None:
    """A run takes its channels from the first image (`--channels=0`): a folder whose first
    photo is grayscale trains every colour photo as gray. Both commands say so, with the fix;
    a folder of one mode gets no such line."""
    rng = np.random.default_rng(0)
    mixed, gray = tmp_path / "mixed", tmp_path / "gray"
    for folder, shapes in ((mixed, [(8, 8)] + [(8, 8, 3)] * 5 + [(8, 8)]), (gray, [(8, 8)] * 4)):
        folder.mkdir()
        for i, shape in enumerate(shapes):
            pixels = rng.integers(0, 256, shape, dtype=np.uint8)
            Image.fromarray(pixels).save(folder / f"{i:02d}.png")
    assert main(["write", str(mixed), str(tmp_path / "m"), "--per_shard", "3"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    assert (
        f"the first image ({mixed / '00.png'}) is grayscale (L), so a run trains 1 channel "
        "(--channels=0: as the first image), but 5 of the 7 images are in colour (RGB 5); "
        "--channels=3 trains colour"
    ) in text
    assert main(["inspect", str(tmp_path / "m")]) == 0
    text = " ".join(capsys.readouterr().out.split())
    assert (
        "modes RGB 5, L 2: all converted to L (1 channel, as the first image); --channels=3" in text
    )
    assert main(["write", str(gray), str(tmp_path / "g")]) == 0
    assert main(["inspect", str(tmp_path / "g")]) == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "grayscale" not in text and "--channels" not in text


def test_inspect_counts_and_names_samples_with_nan_or_inf(tmp_path: Path, capsys) -> None:
    """What a user hit: shards of vectors holding NaN passed `inspect` (0 bad samples), then the
    run stopped on a non-finite loss naming them `(non-finite input)`. Inspect now counts such
    samples and names the shard and keys of the first few, as the run does; exit 1 (damage)."""
    rows = np.zeros((30, 6), np.float32)
    rows[[0, 5, 7, 8, 9, 11], 1] = np.nan  # the first too: it fixes the decoder
    rows[25, 0] = np.inf
    np.save(tmp_path / "x.npy", rows)
    out = tmp_path / "out"
    assert main(["write", str(tmp_path / "x.npy"), str(out), "--per_shard", "20"]) == 0
    capsys.readouterr()
    assert main(["inspect", str(out), "--json"]) == 1
    reports = json.loads(capsys.readouterr().out)
    assert [r["nonfinite"] for r in reports] == [6, 1] and [r["bad"] for r in reports] == [[], []]
    assert reports[0]["nonfinite_keys"] == [f"{k:08d}" for k in (0, 5, 7, 8, 9)]  # the first 5
    assert reports[1]["nonfinite_keys"] == ["00000025"]
    assert main(["inspect", str(out)]) == 1
    text = " ".join(capsys.readouterr().out.split())
    first, second = out / "train-000000.tar", out / "train-000001.tar"
    assert (
        f"{first}: 6 samples with non-finite values (NaN/Inf): keys [00000000, 00000005, "
        "00000007, 00000008, 00000009, ...] (non-finite input)"
    ) in text
    assert f"{second}: 1 sample with non-finite values (NaN/Inf): keys [00000025]" in text
    assert "30 samples; 0 bad samples, 7 samples with NaN/Inf, 2 shards with bad data" in text
    # finite data: nothing said, exit 0
    np.save(tmp_path / "ok.npy", np.ones((4, 6), np.float32))
    assert main(["write", str(tmp_path / "ok.npy"), str(tmp_path / "ok")]) == 0
    assert main(["inspect", str(tmp_path / "ok")]) == 0
    assert "non-finite" not in capsys.readouterr().out
