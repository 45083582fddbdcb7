"""User errors: a mistake in what the user gave us (flags, a config file, a shard spec, bad data,
a busy output folder). Each kind derives from `UserError`; entry points catch it once and print
`render()`: one message that names the key or file, never a traceback."""

from __future__ import annotations


class UserError(Exception):
    """A problem the user can fix; `render()` is the whole message they see."""

    exit_code = 2

    def render(self) -> str:
        return str(self)
