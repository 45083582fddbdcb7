"""User errors: a mistake in what the user gave us (flags, a config file, a shard spec, bad data,
a busy output folder). Each kind derives from `UserError`; entry points catch it once and print
`render()`: one message that names the key or file, never a traceback."""

from __future__ import annotations


class UserError(Exception):
    """A problem the user can fix; `render()` is the whole message they see."""

    exit_code = 2

    def render(self) -> str:
        return str(self)


class ResourceLimitError(UserError):
    """A limit of the machine that the run cannot work within (`/dev/shm`, disk, host memory,
    open files), found before the first batch: each problem names the resource, its size, the
    need and the fix. `tight` are the limits near their end beside them (`Resource tight:` lines):
    said in the same message, as the rank that refuses first may be the only one heard."""

    def __init__(self, problems: list[str], tight: list[str] | None = None) -> None:
        super().__init__("\n".join(problems))
        self.problems, self.tight = problems, tight or []

    def render(self) -> str:
        head = "The run cannot work within this machine's limits:"
        return "\n".join([head, *(f"  - {p}" for p in [*self.problems, *self.tight])])


class DiskFullError(OSError):
    """A write found no space left on its filesystem (ENOSPC), with the partial file removed;
    the rank exits with `exit_code` after saying so."""

    exit_code = 28  # ENOSPC's errno: a code no other ending of a rank uses

    def __init__(self, what: str, path: str, free: int | None, total: int | None) -> None:
        """`what` was being written to `path`; `free` and `total` bytes of its filesystem."""
        super().__init__(28, "No space left on device", path)
        self.what, self.free, self.total = what, free, total
