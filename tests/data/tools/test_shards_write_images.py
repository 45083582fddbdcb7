"""`ae-shards write` of image files given one by one (an unquoted pattern the shell expanded)
and of a quoted glob."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from PIL import Image

from ae.cli.shards import main
from ae.data.shards.tar_samples import iter_samples


def test_write_takes_image_files_an_unquoted_glob_and_a_quoted_one(tmp_path: Path, capsys) -> None:
    """`ae-shards write photos/*.jpg data/x`, the shell's expansion of an unquoted pattern, was
    argparse's `unrecognized arguments: photos/b.jpg ... data/x`; a quoted `'photos/*.jpg'`
    was `no such file or folder`. Both now write the files they name."""
    src = tmp_path / "photos"
    (src / "2023").mkdir(parents=True)
    for i, name in enumerate(["a.jpg", "b.jpg", "c.png", "2023/d.jpg"]):
        Image.fromarray(np.full((8, 8, 3), i * 40, np.uint8)).save(src / name)
    (src / "notes.txt").write_text("hello")
    jpgs = [str(p) for p in sorted(src.glob("*.jpg"))]
    assert main(["write", *jpgs, str(tmp_path / "x")]) == 0
    assert "Wrote 2 samples into 1 shard" in capsys.readouterr().out
    paths = [s["path"] for s in iter_samples(str(tmp_path / "x" / "train-000000.tar"))]
    assert paths == [b"a.jpg", b"b.jpg"]
    assert main(["write", f"{src}/**/*.jpg", str(tmp_path / "y")]) == 0
    paths = [s["path"] for s in iter_samples(str(tmp_path / "y" / "train-000000.tar"))]
    assert paths == [b"2023/d.jpg", b"a.jpg", b"b.jpg"]
    # everything the shell's photos/* gives: folders too, and a file that is not an image
    assert main(["write", *sorted(str(p) for p in src.iterdir()), str(tmp_path / "z")]) == 0
    text = capsys.readouterr().out
    assert "Wrote 4 samples" in text and "left out 1 file that is not an image (.txt)" in text
    assert main(["write", f"{src}/*.gif", str(tmp_path / "w")]) == 2
    np.save(tmp_path / "x.npy", np.zeros((3, 4), np.float32))
    assert main(["write", str(tmp_path / "x.npy"), *jpgs[:1], str(tmp_path / "w")]) == 2
    assert not (tmp_path / "w").exists()


def test_write_names_photos_a_viewer_would_turn_by_their_exif_orientation(
    tmp_path: Path, capsys
) -> None:
    """A phone's portrait photo is stored on its side with EXIF orientation 6; a run decodes the
    pixels as stored (as WebDataset does), so it trained sideways without a word."""
    src = tmp_path / "photos"
    src.mkdir()
    pixels = np.zeros((8, 12, 3), np.uint8)
    Image.fromarray(pixels).save(src / "a_upright.jpg")
    for name, tag in (("b_portrait.jpg", 6), ("c_flipped.jpg", 3)):
        exif = Image.Exif()
        exif[0x0112] = tag
        Image.fromarray(pixels).save(src / name, exif=exif)
    assert main(["write", str(src), str(tmp_path / "out")]) == 0
    text = " ".join(capsys.readouterr().out.split())
    assert (
        "2 images are stored turned, with an EXIF orientation that viewers apply and a run does "
        f"not (it decodes the pixels as stored, as WebDataset does): {src / 'b_portrait.jpg'}: "
        f"on its side; {src / 'c_flipped.jpg'}: upside down; to train upright, turn the files "
        "first"
    ) in text
    assert "a_upright" not in text
