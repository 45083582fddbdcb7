"""The run's input field: never chosen by tar order when a sample has several decodable fields;
and a grayscale first photo among colour ones (the channels it sets) is said."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from ae.config import DataConfig
from ae.data.datamodule import ShardDataModule
from ae.data.decoding.decode import several_inputs
from ae.data.input_probe import probe_decoder
from ae.data.shards.errors import DataError
from ae.data.shards.writer import npy_bytes, png_bytes, write_shard
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


def _photo_shards(tmp_path: Path, modes: list[str]) -> list[str]:
    """Shards of 8x8 PNGs, one per letter of each string (`g`: grayscale L, `c`: colour RGB),
    one shard per string: what `ae-shards write` makes of a folder of such photos."""
    rng, urls, key = np.random.default_rng(0), [], 0
    for i, letters in enumerate(modes):
        samples = []
        for letter in letters:
            shape = (8, 8) if letter == "g" else (8, 8, 3)
            pixels = png_bytes(rng.integers(0, 256, shape, dtype=np.uint8))
            samples.append({"__key__": f"{key:08d}".encode(), "png": pixels})
            key += 1
        write_shard(tmp_path / f"train-{i:06d}.tar", samples)
        urls.append(str(tmp_path / f"train-{i:06d}.tar"))
    return urls


def test_a_grayscale_first_photo_among_colour_ones_is_a_warning_naming_channels_3(
    tmp_path: Path, records: list[tuple[str, str]]
) -> None:
    """What a user hit: the first photo of a folder was grayscale, so the run trained 1 channel
    (`--channels=0`: as the first image) and took every colour photo to gray, silently. The
    rule stays; the probe now looks at a few more headers and says what it saw, and the fix."""
    urls = _photo_shards(tmp_path, ["gccg", "cgg", "c"])
    dm = ShardDataModule(DataConfig(), urls, urls, seed=0)
    assert dm.probe().shape == (1, 8, 8)  # the documented rule: as the first image
    warnings = [message for level, message in records if level == "WARNING"]
    assert warnings == [
        "Images: the first is grayscale (L), so this run trains 1 channel, but 4 of the next 5 "
        "looked at are in colour (RGB 4); --channels=3 trains colour"
    ]
    # The other ranks say it in their own log only: one WARNING line in the train log.
    records.clear()
    ShardDataModule(DataConfig(), urls, urls, seed=0, rank=1).probe()
    assert not [m for level, m in records if level == "WARNING"]
    assert any(m.startswith("Images: the first is grayscale (L)") for _, m in records)


@pytest.mark.parametrize(
    ("modes", "channels", "shape"),
    [
        (["gggg", "gg"], 0, (1, 8, 8)),  # all grayscale
        (["cccc", "cc"], 0, (3, 8, 8)),  # all colour
        (["cggg", "gg"], 0, (3, 8, 8)),  # colour first: grayscale ones become RGB, as inspect says
        (["gccc", "cc"], 1, (1, 8, 8)),  # grayscale asked for
    ],
)
def test_photos_of_one_mode_or_an_explicit_channels_get_no_warning(
    tmp_path: Path,
    records: list[tuple[str, str]],
    modes: list[str],
    channels: int,
    shape: tuple[int, ...],
) -> None:
    """A healthy run's train log has no WARNING line (docs/CONTRACT.md)."""
    urls = _photo_shards(tmp_path, modes)
    assert ShardDataModule(DataConfig(channels=channels), urls, urls, seed=0).probe().shape == shape
    assert [m for level, m in records if level == "WARNING"] == []
    assert not any("Images:" in m for _, m in records)
