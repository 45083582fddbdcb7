"""Keys with dots: WebDataset cuts a member's name at the FIRST dot of its file name, so files
`c.0001.png`, `c.0002.png`, ... read as one sample; the messages say so, the writer avoids it."""

from __future__ import annotations

import io
import json
import tarfile
from pathlib import Path

import numpy as np
import pytest

from ae.cli.shards import main as ae_shards
from ae.config import DataConfig
from ae.data.datamodule import ShardDataModule
from ae.data.shards.errors import DataError
from ae.data.shards.keys import merged_files, safe_key
from ae.data.shards.tar_samples import iter_samples
from ae.data.shards.writer import png_bytes, write_shard


def _dotted_shard(path: Path, n: int = 6) -> str:
    """What TarWriter writes for keys `a/b/c.0001`, ...: members `a/b/c.0001.png`, ..."""
    png = png_bytes(np.zeros((4, 4), np.uint8))
    with tarfile.open(path, "w") as tar:
        for i in range(n):
            info = tarfile.TarInfo(f"a/b/c.{i:04d}.png")
            info.size = len(png)
            tar.addfile(info, io.BytesIO(png))
    return str(path)


def test_too_few_samples_says_the_keys_were_cut_at_the_first_dot(tmp_path: Path) -> None:
    url = _dotted_shard(tmp_path / "d.tar")
    (sample,) = iter_samples(url)  # six files, one sample
    assert sample["__key__"] == "a/b/c" and "0005.png" in sample
    dm = ShardDataModule(DataConfig(batch_size=2, num_workers=0), [url], [url], seed=0)
    with pytest.raises(DataError) as err:
        dm.setup("fit")
    text = err.value.render()
    # The probe stops it before the planner counts: six decodable fields, explained as one cut.
    assert text.startswith("input_key: the samples have 6 decodable fields (0000.png, ")
    assert "--input_key=" not in text  # no field of these is the fix
    assert "sample a/b/c has 6 fields ending in .png" in text
    assert "FIRST dot of its file name" in text and "a/b/c_0000.png" in text


def test_inspect_names_the_merged_sample_and_the_fix(tmp_path: Path, capsys) -> None:
    url = _dotted_shard(tmp_path / "d.tar")
    ae_shards(["inspect", url, "--json"])
    (report,) = json.loads(capsys.readouterr().out)
    assert "FIRST dot" in report["merged"] and "Fix: rename" in report["merged"]
    ae_shards(["inspect", url])
    assert "- sample a/b/c has 6 fields ending in .png" in capsys.readouterr().out


def test_ordinary_multi_field_samples_are_not_flagged() -> None:
    assert merged_files("k", ["rgb.png", "seg.png", "depth.png", "cls", "json"]) is None
    assert merged_files("k", [f"{i:04d}.jpg" for i in range(4)]) is not None


def test_the_writer_never_writes_a_key_whose_file_name_has_a_dot(tmp_path: Path) -> None:
    assert safe_key("a.b/c.0001") == "a.b/c_0001"  # folders keep their dots
    path = tmp_path / "w.tar"
    samples = [{"__key__": k.encode(), "cls": b"1"} for k in ("a/c.0001", "a/c_0001", "x")]
    write_shard(path, samples)
    keys = [s["__key__"] for s in iter_samples(str(path))]
    assert keys == ["a/c_0001", "a/c_0001_2", "x"]  # one sample each, keys unique
