"""Shard specs: what matches, and the one message for what does not."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from ae.data.shards.spec import ShardSpecError, expand_shards


def test_directories_globs_and_braces_find_the_shards(tmp_path: Path) -> None:
    for name in ("a-000000.tar", "a-000001.tar", "sub/b-000000.tar.gz", "notes.txt"):
        (tmp_path / name).parent.mkdir(exist_ok=True)
        (tmp_path / name).write_bytes(b"")
    found = [str(tmp_path / n) for n in ("a-000000.tar", "a-000001.tar", "sub/b-000000.tar.gz")]
    assert expand_shards(str(tmp_path)) == found
    assert expand_shards(f"{tmp_path}/a-*.tar") == found[:2]
    assert expand_shards(f"{tmp_path}/a-{{000000..000001}}.tar::{found[2]}") == found
    with pytest.raises(ShardSpecError, match=r"val_shards: 1 of 2 shard files missing: .*a-000002"):
        expand_shards(f"{tmp_path}/a-00000{{1..2}}.tar", "val_shards")


def test_what_ae_shards_write_takes_gets_its_hint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A new user's first try: the raw photos folder or the .npy itself, named as shards."""
    photos = tmp_path / "photos"
    (photos / "sub").mkdir(parents=True)
    (photos / "sub" / "cat.jpg").write_bytes(b"")
    with pytest.raises(ShardSpecError) as err:
        expand_shards(str(photos))
    assert str(err.value) == (
        f"train_shards: '{photos}' matches no shard files; it holds images (cat.jpg, ...): "
        f"ae-shards write {photos} DIR makes shards of them"
    )
    np.save(tmp_path / "emb.npy", np.zeros((4, 2)))
    with pytest.raises(ShardSpecError) as err:
        expand_shards(str(tmp_path / "emb.npy"))
    assert str(err.value) == (
        f"train_shards: {tmp_path / 'emb.npy'} is .npy data, not a shard; make shards of it "
        f"first: ae-shards write {tmp_path / 'emb.npy'} DIR, then --train_shards=DIR"
    )
    # a glob of the photos themselves: ae-shards write takes their folder, not a photo
    with pytest.raises(ShardSpecError) as err:
        expand_shards(f"{photos}/*/*.jpg")
    assert str(err.value) == (
        f"train_shards: {photos / 'sub' / 'cat.jpg'} is .jpg data, not a shard; make shards of "
        f"the images first: ae-shards write {photos / 'sub'} DIR, then --train_shards=DIR"
    )
    # relative and absolute photos at once (no common folder): the first one's
    (tmp_path / "rel").mkdir()
    (tmp_path / "rel" / "dog.png").write_bytes(b"")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ShardSpecError, match=r"ae-shards write rel DIR, then"):
        expand_shards(f"rel/dog.png::{photos}/sub/cat.jpg")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ShardSpecError, match=r"'\S+empty' matches no shard files$"):
        expand_shards(str(tmp_path / "empty"))  # nothing to suggest


def test_braces_that_do_not_expand_are_named(tmp_path: Path) -> None:
    """Three dots in a range, an unclosed brace: one message naming the fix (the unclosed one
    was braceexpand's traceback on the console)."""
    with pytest.raises(ShardSpecError) as err:
        expand_shards(f"{tmp_path}/train-{{000000...000003}}.tar")
    assert str(err.value).endswith(
        "train-{000000...000003}.tar; its braces did not expand: a range is {000000..000099} "
        "(two dots), a list {a,b}, each brace closed"
    )
    with pytest.raises(ShardSpecError) as err:
        expand_shards(f"{tmp_path}/train-{{0..3.tar", "val_shards")
    assert str(err.value) == (
        f"val_shards: '{tmp_path}/train-{{0..3.tar' has a brace that is not closed (a range is "
        "{000000..000099}, a list {a,b})"
    )


def test_a_url_scheme_no_shard_is_opened_by_names_the_pipe_that_streams_it() -> None:
    """`s3://` went through the spec and failed in every rank ~10 s later: `ValueError:
    s3://b/a-000000.tar: no gopen handler defined` (a raw traceback in `ae-shards inspect`)."""
    with pytest.raises(ShardSpecError) as err:
        expand_shards("s3://bucket/train-{000000..000007}.tar", "val_shards")
    assert str(err.value) == (
        "val_shards: 's3://bucket/train-{000000..000007}.tar': ae opens http(s):// and gs:// "
        "URLs and local paths, not s3://; stream the shards through a command that writes each "
        "one to stdout: --val_shards='pipe:aws s3 cp s3://bucket/train-{000000..000007}.tar -'"
    )
    with pytest.raises(ShardSpecError, match=r"not az://; .*--train_shards='pipe:CMD'"):
        expand_shards("data/a.tar::az://c/a.tar")
    with pytest.raises(ShardSpecError, match=r"by their path \(/data/a.tar\), not a file://"):
        expand_shards("file:///data/a.tar")
    urls = ["http://h:8000/a.tar", "gs://b/a.tar", "pipe:aws s3 cp s3://b/a.tar -"]
    assert expand_shards("::".join(urls)) == urls
    with pytest.raises(
        ShardSpecError, match=r"^SPEC: .* to stdout: 'pipe:aws s3 cp s3://b/a.tar -'$"
    ):
        expand_shards("s3://b/a.tar", "SPEC")  # ae-encode, ae-shards: no flag to name
