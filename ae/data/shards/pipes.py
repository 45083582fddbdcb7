"""A shard read through a command -- `curl` for an `http(s)://` URL, the user's own for
`pipe:CMD` -- and its failure said plainly.

WebDataset's `gopen` runs the command and, when it exits non-zero, raises an OSError whose text is
its Python call (`((['curl', '--connect-timeout', '30', ...],), {'bufsize': 8192}): exit 7 (read)
{}`). `plain_errors` wraps such a stream so that its failure reads `could not download it: curl
exit 7 (could not connect to the server)` or `the command `CMD` exited 3`; the callers put the
shard's URL in front, as for any other unreadable shard.
"""

from __future__ import annotations

from typing import IO, Any

# What curl's exit codes mean (`man curl`, EXIT CODES): those a download of a shard meets.
CURL_EXIT = {
    5: "could not resolve the proxy",
    6: "could not resolve the host name",
    7: "could not connect to the server: nothing listening, or a firewall",
    18: "the transfer ended early: only part of the file came",
    22: "the server answered with an HTTP error (404 not found, 403 forbidden, ...)",
    28: "timed out",
    35: "the TLS/SSL handshake failed",
    47: "too many redirects",
    52: "the server sent nothing",
    56: "the connection broke while receiving",
    60: "the server's certificate could not be verified",
}


class ShardCommandError(OSError):
    """The command that reads a shard failed (`describe` says which and how)."""


def describe(command: Any, status: int) -> str:
    """The failure of the shard's reading command `command` (argv list or shell string)."""
    argv = command if isinstance(command, list | tuple) else None
    if argv and argv[0] == "curl":
        meaning = CURL_EXIT.get(status, "see `man curl`, EXIT CODES")
        return f"could not download it: curl exit {status} ({meaning})"
    text = " ".join(map(str, argv)) if argv is not None else str(command)
    # The shell's own codes (`pipe:` runs CMD in a shell): a misspelt or uninstalled program
    why = {126: " (not executable)", 127: " (command not found: is it installed, on PATH?)"}
    return f"the command `{text}` exited {status}{why.get(status, '')}"


class PlainErrors:
    """A WebDataset `Pipe` stream whose failure (on a read, or on close, when the command's exit
    status is checked) is a ShardCommandError in plain words."""

    def __init__(self, pipe: Any) -> None:
        self.pipe = pipe

    def _plain(self, error: OSError) -> OSError:
        status = getattr(self.pipe, "status", None)
        if not isinstance(status, int) or status == 0:
            return error  # not the command's exit (a broken pipe, a read error): as it came
        args = getattr(self.pipe, "args", None)
        command = args[0][0] if args and args[0] else "?"
        return ShardCommandError(describe(command, status))

    def read(self, n: int = -1) -> bytes:
        try:
            return self.pipe.read(n)
        except OSError as e:
            raise self._plain(e) from None

    def close(self) -> None:
        try:
            self.pipe.close()
        except OSError as e:
            raise self._plain(e) from None

    def __enter__(self) -> PlainErrors:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.pipe, name)


def plain_errors(stream: IO[bytes]) -> IO[bytes]:
    """`stream`, wrapped when it is a command's output (WebDataset's `Pipe`)."""
    from webdataset.gopen import Pipe  # here: webdataset imports torch (see tar_samples)

    return PlainErrors(stream) if isinstance(stream, Pipe) else stream  # type: ignore[return-value]
