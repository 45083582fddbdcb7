"""The run's input field: never chosen by tar order when a sample has several decodable fields."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from ae.config import DataConfig
from ae.data.decoding.decode import several_inputs
from ae.data.input_probe import probe_decoder
from ae.data.shards.errors import DataError
from ae.data.shards.writer import npy_bytes, write_shard
from tests.support.shards import image_samples


def test_an_array_sorting_before_the_image_field_is_refused_naming_the_fields_and_input_key(
    tmp_path: Path,
) -> None:
    """What a user hit: an extra `a.npy` of zeros sorted before `png` and became the input.
    Now the probe (before any dataloader worker) refuses, and --input_key picks either."""
    zeros = npy_bytes(np.zeros(3, np.float32))
    samples = [  # in tar order, as TarWriter sorts the fields: a.npy, cls, png
        {"__key__": s["__key__"], "a.npy": zeros, "cls": b"1", "png": s["png"]}
        for s in image_samples(4)
    ]
    write_shard(tmp_path / "t.tar", samples)
    urls = [str(tmp_path / "t.tar")]
    with pytest.raises(DataError) as err:
        probe_decoder("train", urls, DataConfig())
    text = err.value.render()
    assert text == (
        "input_key: the samples have 2 decodable fields (a.npy, png, in sample 00000000); name "
        "the one to train on with --input_key, e.g. --input_key=a.npy"
    )
    assert probe_decoder("train", urls, DataConfig(input_key="png")).kind == "image"
    assert probe_decoder("train", urls, DataConfig(input_key="a.npy")).shape == (3,)


@pytest.mark.parametrize(
    "fields", [("jpg", "png"), ("b.npy", "a.npy"), ("emb.pth", "x.npz", "image.webp")]
)
def test_any_two_decodable_fields_are_several_inputs_and_undecodable_ones_do_not_count(
    fields: tuple[str, ...],
) -> None:
    sample = {"__key__": "k7", "__url__": "u", "cls": b"1", "meta.json": b"{}"}
    assert several_inputs({**sample, fields[0]: b""}) is None  # one: the input
    problem = several_inputs({**sample, **dict.fromkeys(fields, b"")})
    assert problem is not None and f"({', '.join(fields)}, in sample k7)" in problem
