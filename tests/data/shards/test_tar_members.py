import io
import tarfile

import pytest

from ae.data.shards.tar_members import CorruptTar, TruncatedTar, iter_members


def _tar(members: list[tuple[str, bytes]], fmt: int = tarfile.USTAR_FORMAT, dirs=()) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=fmt) as tar:
        for d in dirs:
            info = tarfile.TarInfo(d)
            info.type = tarfile.DIRTYPE
            tar.addfile(info)
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


MEMBERS = [("000001.npy", b"x" * 700), ("000001.cls", b"3"), ("000002.npy", b""), ("a/b.c", b"y")]
LONG = "d" * 120 + "/" + "n" * 130 + ".npy"


@pytest.mark.parametrize("fmt", [tarfile.USTAR_FORMAT, tarfile.GNU_FORMAT, tarfile.PAX_FORMAT])
def test_same_members_as_tarfile(fmt: int) -> None:
    members = MEMBERS if fmt == tarfile.USTAR_FORMAT else [*MEMBERS, (LONG, b"long" * 300)]
    data = _tar(members, fmt, dirs=["somedir"])
    assert list(iter_members(io.BytesIO(data))) == members


def test_ustar_prefix_names() -> None:
    name = "p" * 90 + "/" + "q" * 90 + ".png"  # > 100 chars: ustar splits it into prefix/name
    assert list(iter_members(io.BytesIO(_tar([(name, b"z")])))) == [(name, b"z")]


def test_pax_unicode_name() -> None:
    name = "ключ/ü.npy"
    assert list(iter_members(io.BytesIO(_tar([(name, b"1")], tarfile.PAX_FORMAT)))) == [
        (name, b"1")
    ]


def test_truncated_inside_member_and_header() -> None:
    data = _tar(MEMBERS)
    got = []
    with pytest.raises(TruncatedTar, match="inside a member"):
        for m in iter_members(io.BytesIO(data[: 512 + 300])):
            got.append(m)
    assert got == []
    with pytest.raises(TruncatedTar, match="inside a header"):
        list(iter_members(io.BytesIO(data[: 512 * 3 + 100])))
    with pytest.raises(TruncatedTar, match="end-of-archive") as err:
        list(iter_members(io.BytesIO(data[:2560])))  # cut between two members
    assert err.value.member is None
    with pytest.raises(TruncatedTar, match="inside a member") as err:
        list(iter_members(io.BytesIO(data[: 512 + 800])))  # body whole, padding cut
    assert err.value.member == "000001.npy"


def test_garbage_is_corrupt() -> None:
    with pytest.raises(CorruptTar):
        list(iter_members(io.BytesIO(b"not a tar file at all " * 40)))
    data = bytearray(_tar(MEMBERS))
    data[10] ^= 0xFF  # flip a name byte: checksum no longer matches
    with pytest.raises(CorruptTar, match="checksum"):
        list(iter_members(io.BytesIO(bytes(data))))


def test_short_reads_from_pipes() -> None:
    class Trickle(io.RawIOBase):
        def __init__(self, data: bytes) -> None:
            self.buf = io.BytesIO(data)

        def read(self, n: int = -1) -> bytes:
            return self.buf.read(min(n, 100) if n >= 0 else 100)

    assert list(iter_members(Trickle(_tar(MEMBERS)))) == MEMBERS
