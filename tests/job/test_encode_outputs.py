"""ae-encode run again into its OUT_DIR: complete outputs of the same checkpoint and settings are
skipped, the rest encoded; anything else there is refused as before (`ae.job.encode_outputs`)."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import pytest

from ae.data.decoding.decode import InputSpec
from ae.data.shards.writer import write_shard
from ae.job import encode as job_encode
from ae.job.encode import EncodeArgsError, check_outputs, output_paths
from ae.job.encode_outputs import (
    Record,
    Settings,
    is_complete,
    job_outputs,
    read_record,
    remove_leftovers,
    skipped_outputs,
    survey,
    updated_record,
    write_record,
)
from tests.support.encode_checkpoint import encode_checkpoint
from tests.support.shards import vector_samples

SETTINGS = Settings("ab" * 32, "latent.npy", "float32", [])


def _outputs(tmp_path: Path, n: int) -> tuple[list[str], list[Path]]:
    """`n` input names and their outputs, every output written whole (as a rank writes it)."""
    urls = [str(tmp_path / "in" / f"train-{i:06d}.tar") for i in range(n)]
    outs = output_paths(urls, tmp_path / "out")
    for i, out in enumerate(outs):
        write_shard(out, vector_samples(3, 2, 3 * i))
    return urls, outs


def test_complete_outputs_of_the_same_settings_are_skipped_the_rest_redone(
    tmp_path: Path,
) -> None:
    """ae-encode of 50 shards stopped at shard 30, run again: it refused the folder (its own
    outputs) and said to pass --overwrite, which encoded all 50 again. Now the complete ones
    are skipped; a shard without its index (killed between the two renames) or cut short (a
    machine that lost power: writes are not fsynced) is encoded again."""
    urls, outs = _outputs(tmp_path, 5)
    out_dir = tmp_path / "out"
    write_record(out_dir, Record(SETTINGS, job_outputs(urls, outs)))
    Path(f"{outs[1]}.idx").unlink()
    size = outs[2].stat().st_size
    outs[2].write_bytes(outs[2].read_bytes()[: size - 1024] + b"\1" * 1024)  # no end blocks
    outs[4].unlink()  # never written
    found = survey(urls, outs, read_record(out_dir), SETTINGS)
    assert (found.done, found.redo, found.foreign) == ([0, 3], [1, 2], [])
    assert found.todo(5) == [1, 2, 4]
    check_outputs(urls, outs, found=found)  # nothing refused
    assert skipped_outputs(urls, outs, out_dir, overwrite=False) == [0, 3]
    assert skipped_outputs(urls, outs, out_dir, overwrite=True) == []  # --overwrite: all again
    assert not is_complete(outs[1]) and not is_complete(outs[2]) and is_complete(outs[3])


def test_outputs_of_another_checkpoint_settings_or_input_are_refused(tmp_path: Path) -> None:
    """Skipping must never mix latents: outputs that the record does not vouch for are refused
    without --overwrite, with the reason."""
    urls, outs = _outputs(tmp_path, 2)
    out_dir = tmp_path / "out"
    write_record(out_dir, Record(SETTINGS, job_outputs(urls, outs)))
    other = dataclasses.replace(SETTINGS, checkpoint_sha256="cd" * 32, dtype="float16")
    found = survey(urls, outs, read_record(out_dir), other)
    assert found.foreign == [0, 1] and not found.done
    with pytest.raises(EncodeArgsError) as err:
        check_outputs(urls, outs, found=found)
    assert "and an earlier ae-encode wrote them with another checkpoint, --dtype; encode" in (
        err.value.render()
    )
    check_outputs(urls, outs, overwrite=True, found=found)
    # The same names from other input shards (ae-encode a/ then b/ into one folder)
    moved = [u.replace("/in/", "/elsewhere/") for u in urls]
    found = survey(moved, outs, read_record(out_dir), SETTINGS)
    assert found.foreign == [0, 1]
    assert f"wrote train-000001.tar from another input shard ({urls[1]})" in found.why
    # A relative spec names the same files as the absolute one
    rel = [os.path.relpath(u) for u in urls]
    assert survey(rel, outs, read_record(out_dir), SETTINGS).done == [0, 1]


def test_the_record_keeps_outputs_of_the_same_settings_only() -> None:
    old = Record(SETTINGS, {"a.tar": "/in/a.tar"})
    assert updated_record(old, SETTINGS, {"b.tar": "/in/b.tar"}).outputs == {
        "a.tar": "/in/a.tar",
        "b.tar": "/in/b.tar",
    }
    other = dataclasses.replace(SETTINGS, field="z.npy")
    # --overwrite with other settings: a.tar is no longer vouched for (it holds old latents)
    assert updated_record(old, other, {"b.tar": "/in/b.tar"}).outputs == {"b.tar": "/in/b.tar"}


def test_temporary_files_of_a_killed_rank_are_removed(tmp_path: Path) -> None:
    _, outs = _outputs(tmp_path, 2)
    ours = [outs[0].with_name(f".{outs[0].name}.1234-0badcafe.tmp"),
            outs[1].with_name(f".{outs[1].name}.idx.1234-0badcafe.tmp")]  # fmt: skip
    theirs = outs[0].with_name(".other.tar.1234-0badcafe.tmp")
    for temp in [*ours, theirs]:
        temp.write_bytes(b"half a shard")
    assert remove_leftovers(outs) == 2
    assert theirs.exists() and not any(t.exists() for t in ours)


def test_a_run_again_encodes_only_what_is_missing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, said: list[str]
) -> None:
    """The launcher end to end, the ranks replaced: the first run writes the record before
    they start; a second run of the same command starts ranks for the missing shards only and
    says how many it skipped; once all are there it starts none; another checkpoint is
    refused; --overwrite encodes everything again."""
    ckpt = encode_checkpoint(tmp_path, InputSpec("vector", (12,)))
    urls = [str(tmp_path / "in" / f"train-{i:06d}.tar") for i in range(3)]
    for i, url in enumerate(urls):
        write_shard(Path(url), vector_samples(4, 12, 4 * i))
    out = tmp_path / "out"
    argv = [ckpt, str(tmp_path / "in"), out, "--devices=1"]
    started: list[list[int]] = []

    def ranks_run(module: str, debug: bool, args: list[str], **kwargs: object) -> tuple[int, None]:
        outs = output_paths(urls, out)
        todo = skipped_outputs(urls, outs, out, overwrite="--overwrite" in args)
        started.append([i for i in range(3) if i not in todo])
        for i in started[-1][:2]:  # a run that stops after two shards
            write_shard(outs[i], vector_samples(4, 3, 4 * i))
        return 0, None

    monkeypatch.setattr(job_encode, "run_ranks", ranks_run)
    monkeypatch.setattr(job_encode, "check_checkpoint", lambda args: None)  # a process

    def launch(*extra: str) -> int:
        return job_encode.launch([*map(str, argv), *extra])

    assert launch() == 0
    assert read_record(out) is not None and started == [[0, 1, 2]]
    assert launch() == 0
    assert started[-1] == [2]
    assert any(
        line.startswith(f"Encoding 1 shards (2 of 3 complete in {out} from an earlier run")
        for line in said
    )
    said.clear()
    assert launch() == 0 and len(started) == 2  # no ranks started
    assert said == [
        f"Nothing to encode: all 3 output shards are complete in {out} from an earlier run of "
        "this command; --overwrite encodes them again"
    ]
    other = tmp_path / "other.ckpt"
    other.write_bytes(Path(ckpt).read_bytes() + b"\0")
    argv[0] = other
    assert launch() == 2 and "with another checkpoint" in said[-1]
    assert launch("--overwrite") == 0 and started[-1] == [0, 1, 2]
