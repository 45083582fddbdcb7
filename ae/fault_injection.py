"""Faults on demand, for tests only: `AE_FAULT="kind@point[:n],..."` in the environment.

Code that tests need to break calls `fault_point("name")` at the spot. With `AE_FAULT` unset (every
real run) it returns at once: one dict lookup. Kinds:
- `oom`: raise `torch.cuda.OutOfMemoryError` (also exists in CPU builds), as a real CUDA OOM would;
- `kill`: SIGKILL this process (no handler, no cleanup: what the OOM killer or a node loss does);
- `raise`: raise RuntimeError.
`:n` fires only at the n-th time this process reaches the point (1-based); without it, every time.
Example: `AE_FAULT="oom@sampling:1,kill@checkpoint:2"`.
"""

from __future__ import annotations

import os
import signal
from collections import Counter

_hits: Counter[str] = Counter()


def _armed(name: str, spec: str) -> list[tuple[str, int | None]]:
    """The (kind, nth) faults of `spec` that target point `name`."""
    out = []
    for item in filter(None, (s.strip() for s in spec.split(","))):
        kind, _, where = item.partition("@")
        point, _, nth = where.partition(":")
        if point == name:
            out.append((kind, int(nth) if nth else None))
    return out


def fault_point(name: str) -> None:
    spec = os.environ.get("AE_FAULT")
    if not spec:
        return
    _hits[name] += 1
    for kind, nth in _armed(name, spec):
        if nth is not None and nth != _hits[name]:
            continue
        message = f"injected by AE_FAULT at {name} (hit {_hits[name]})"
        if kind == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        if kind == "oom":
            import torch  # only here: this module is imported by torch-free code too

            raise torch.cuda.OutOfMemoryError(f"CUDA out of memory ({message})")
        if kind == "raise":
            raise RuntimeError(message)
        raise ValueError(f"AE_FAULT: unknown fault kind {kind!r} in {spec!r}")
