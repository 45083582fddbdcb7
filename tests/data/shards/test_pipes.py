"""A shard read through a command (`curl` for http(s)://, `pipe:CMD`) that fails: the error says
what failed in plain words, never WebDataset's argument tuple (ae.data.shards.pipes)."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest
from loguru import logger

from ae.config import DataConfig
from ae.data.input_probe import probe_decoder
from ae.data.shards.errors import DataError
from ae.data.shards.index import read_index
from ae.data.shards.pipes import ShardCommandError
from ae.data.shards.tar_header_count import scan_shard
from ae.data.shards.tar_members import CorruptTar
from ae.data.shards.tar_samples import iter_samples
from ae.data.shards.writer import write_shard
from tests.support.shards import vector_samples


def closed_port() -> int:
    """A local port with nothing listening (bound, then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("reader", ["fast", "tarfile"])
def test_a_url_with_nothing_listening_says_curl_could_not_connect(reader: str) -> None:
    url = f"http://127.0.0.1:{closed_port()}/x.tar"
    with pytest.raises(ShardCommandError) as e:
        list(iter_samples(url, reader=reader))  # type: ignore[arg-type]
    assert str(e.value) == (
        "could not download it: curl exit 7 (could not connect to the server: nothing "
        "listening, or a firewall)"
    )


def test_a_failing_pipe_command_is_named_with_its_exit_status() -> None:
    with pytest.raises(ShardCommandError, match=r"^the command `exit 3` exited 3$"):
        list(iter_samples("pipe:exit 3"))


def test_the_no_readable_sample_message_names_the_url_and_what_failed() -> None:
    """What the user reads (exit 2): the URL and curl's failure, not curl's argument tuple."""
    url = f"http://127.0.0.1:{closed_port()}/x.tar"
    with pytest.raises(DataError) as e:
        probe_decoder("train", [url], DataConfig())
    said = e.value.render()
    assert said.startswith("train_shards: no readable sample in any of 1 shards (not one could")
    assert f"last problem: {url}: ShardCommandError: could not download it: curl exit 7" in said
    assert "'--connect-timeout'" not in said and "bufsize" not in said


def test_a_misspelt_pipe_command_says_it_was_not_found() -> None:
    with pytest.raises(ShardCommandError) as e:
        list(iter_samples("pipe:crul -s http://127.0.0.1:1/a.tar"))
    assert str(e.value) == (
        "the command `crul -s http://127.0.0.1:1/a.tar` exited 127 (command not found: is it "
        "installed, on PATH?)"
    )


@pytest.mark.parametrize("reader", ["fast", "tarfile"])
def test_a_reader_that_stops_early_is_not_told_how_the_command_ended(
    reader: str, tmp_path: Path
) -> None:
    """The probe takes the first sample and drops the reader; curl, whose transfer was cut
    after it (exit 18), then failed the close: `Exception ignored in: <generator object
    iter_samples ...>` and a traceback on the run's console."""
    write_shard(tmp_path / "a.tar", vector_samples(6, 4))
    # The shard, then its end (stdout closed), then exit 18 a little later: at the close, not
    # at a read (WebDataset's pipe raises at a read that finds the command already failed)
    cut = f"pipe:cat {tmp_path}/a.tar; exec 1>&-; sleep 0.2; exit 18"
    samples = iter_samples(cut, reader=reader)  # type: ignore[arg-type]
    assert next(samples)["__key__"] == "00000000"
    samples.close()  # raised ShardCommandError: the command `...` exited 18
    with pytest.raises(ShardCommandError, match="exited 18"):  # read to the end: said
        list(iter_samples(cut, reader=reader))  # type: ignore[arg-type]


PAGE_404 = b'<!DOCTYPE HTML>\n<html lang="en">\n<head><title>Error response</title></head>\n'


def test_an_error_page_read_as_a_shard_or_its_sidecar_is_said_so(tmp_path: Path) -> None:
    """`pipe:curl -s URL` (no -f) writes a 404's page out as if it were the file: a missing
    sidecar was a WARNING per shard on the console (`Ignoring malformed index ...: Expecting
    value`), a missing shard `TruncatedTar: stream ends inside a header (335 of 512 bytes)`."""
    write_shard(tmp_path / "a.tar", vector_samples(3, 4))
    (tmp_path / "a.tar.idx").write_bytes(PAGE_404)  # what `curl -s` of a missing .idx gives
    lines: list[str] = []
    sink = logger.add(lambda m: lines.append(m.record["message"]), level="WARNING")
    try:
        assert read_index(f"pipe:cat {tmp_path}/a.tar") is None  # no index: counted by a walk
        assert scan_shard(f"pipe:cat {tmp_path}/a.tar").samples == 3
    finally:
        logger.remove(sink)
    assert lines == []
    (tmp_path / "b.tar").write_bytes(PAGE_404 + b"<body>404</body>\n" * 20)
    with pytest.raises(CorruptTar) as e:
        list(iter_samples(f"pipe:cat {tmp_path}/b.tar"))
    assert str(e.value) == (
        "not a tar but a web page ('<!DOCTYPE HTML>'...): an error page sent instead of the "
        "shard? (curl writes one out unless given -f: pipe:curl -f -s URL)"
    )
    assert "not a tar but a web page" in (scan_shard(f"pipe:cat {tmp_path}/b.tar").error or "")


def test_a_count_cut_by_its_command_keeps_the_whole_samples_and_names_the_cause(
    tmp_path: Path,
) -> None:
    """A transfer cut mid-shard (curl exit 18) was `cannot open: ... (counted 0 whole
    samples)`: the command's failure on close threw the walk's count away."""
    write_shard(tmp_path / "a.tar", vector_samples(6, 4))
    half = (tmp_path / "a.tar").stat().st_size // 2
    command = f"head -c {half} {tmp_path}/a.tar; exec 1>&-; sleep 0.2; exit 18"  # at the close
    scan = scan_shard(f"pipe:{command}")
    assert scan.samples > 0
    assert scan.error == f"ShardCommandError: the command `{command}` exited 18"
