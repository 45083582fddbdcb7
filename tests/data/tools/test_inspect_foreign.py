"""`ae-shards inspect` on shards made by other tools (tarfile, TarWriter): what it says agrees
with what a run does, and stays short whatever the shard holds."""

from __future__ import annotations

import io
import re
import tarfile
from pathlib import Path

import numpy as np
from PIL import Image

from ae.cli.shards import main
from ae.data.decoding.decode import several_inputs


def _png(mode: str = "RGB") -> bytes:
    out = io.BytesIO()
    Image.new(mode, (8, 8), 128).save(out, format="png")
    return out.getvalue()


def _tar(path: Path, members: list[tuple[str, bytes]]) -> Path:
    with tarfile.open(path, "w") as t:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            t.addfile(info, io.BytesIO(data))
    return path


def _text(capsys) -> str:
    return " ".join(capsys.readouterr().out.split())  # rich wraps long lines


def test_inspect_says_a_run_refuses_samples_with_two_images(tmp_path: Path, capsys) -> None:
    # img2dataset-like pairs: a run refuses them without --input_key (input_probe); inspect
    # said only "input field: input.jpg" and the user learnt it from a failed launch
    members = [(f"{i:04d}.{f}", _png(m)) for i in range(4) for f, m in (("input.png", "RGB"),
               ("target.png", "L"))]  # fmt: skip
    shard = _tar(tmp_path / "p.tar", members)
    assert main(["inspect", str(shard)]) == 0
    text = _text(capsys)
    assert "a training run refuses these shards without --input_key: the samples have 2" in text
    assert "(input.png, target.png, in sample 0000)" in text
    assert main(["inspect", str(shard), "--input_key", "target.png"]) == 0
    assert "refuses" not in _text(capsys)


def test_inspect_names_the_first_bad_samples_and_counts_the_rest(tmp_path: Path, capsys) -> None:
    shard = _tar(tmp_path / "c.tar", [(f"{i:06d}.cls", b"3") for i in range(40)])
    assert main(["inspect", str(shard)]) == 1
    out = capsys.readouterr().out
    assert out.count(": sample 0000") == 5  # one line each, not 40
    assert "35 more bad samples (--json lists all)" in " ".join(out.split())
    assert "40 bad samples" in " ".join(out.split())
    assert main(["inspect", str(shard), "--json"]) == 1
    assert '"000039"' in capsys.readouterr().out


def test_inspect_lists_the_first_fields_of_a_sample_with_many(tmp_path: Path, capsys) -> None:
    # dots in the base name: WebDataset reads 30 files as one sample of 30 fields
    shard = _tar(tmp_path / "d.tar", [(f"a.b.{i:03d}.png", _png()) for i in range(30)])
    assert main(["inspect", str(shard)]) == 0
    text = _text(capsys)
    assert "sample a has 30 fields" in text
    assert "b.010.png" not in text and "b.029.png" not in text
    assert "(21 more)" in text  # and the table names 8 fields, then "... (22 more fields)"


def test_several_inputs_names_the_first_fields_only() -> None:
    sample = {"__key__": "k", **{f"{i:03d}.npy": b"" for i in range(50)}}
    why = several_inputs(sample)
    assert why is not None and "50 decodable fields" in why
    assert "007.npy, ... (42 more), in sample k" in why and "049.npy" not in why


def test_bench_names_each_bad_sample_once_and_counts_the_reads(tmp_path: Path, capsys) -> None:
    # img2dataset leaves a sample without its image (only .txt/.json): bench reads it again every
    # epoch, and named it on the console each time (hundreds of lines in a few seconds)
    members = [(f"{i:09d}.png", _png()) for i in range(40)]
    members[5] = ("000000005.txt", b"a caption, the image failed to download")
    shard = _tar(tmp_path / "00000.tar", members)
    args = ["bench", str(shard), "--batch_size", "8", "--num_workers", "0", "--seconds", "0.5"]
    assert main(args) == 0
    captured = capsys.readouterr()
    named = (captured.out + captured.err).count("Bad sample 000000005 in shard")
    assert named == 1
    text = " ".join(captured.out.split())
    assert re.search(r"\d+ reads of bad samples \(named above\), replaced by good ones", text)


def test_label_only_shards_are_not_sent_to_input_key(tmp_path: Path, capsys) -> None:
    # `.cls`-only shards: --input_key cannot help (it names only array and image fields), yet
    # both inspect and the run's refusal said to use it
    shard = _tar(tmp_path / "c.tar", [(f"{i:06d}.cls", b"3") for i in range(3)])
    assert main(["inspect", str(shard)]) == 1
    text = _text(capsys)
    assert "labels and captions (cls, txt, json) are not model inputs, and --input_key" in text
    assert "name the field with --input_key" not in text and "pick the field" not in text
    assert "no sample decodes: no training run can use these shards" in text


def test_inspect_says_2d_arrays_are_flattened(tmp_path: Path, capsys) -> None:
    def npy(a: np.ndarray) -> bytes:
        out = io.BytesIO()
        np.save(out, a)
        return out.getvalue()

    shard = _tar(tmp_path / "v.tar", [(f"{i:06d}.npy", npy(np.zeros((4, 8), np.float32)))
                                      for i in range(3)])  # fmt: skip
    assert main(["inspect", str(shard)]) == 0
    assert "vectors of 32 values: an MLP autoencoder (arrays of shape 4x8 flattened)" in _text(
        capsys
    )
    flat = _tar(tmp_path / "f.tar", [(f"{i:06d}.npy", npy(np.zeros(16, np.float32)))
                                     for i in range(3)])  # fmt: skip
    assert main(["inspect", str(flat)]) == 0
    text = _text(capsys)
    assert "vectors of 16 values: an MLP autoencoder" in text and "flattened" not in text
