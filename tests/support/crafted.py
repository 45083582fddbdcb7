"""A crafted checkpoint: a real ae checkpoint plus one object whose unpickling calls a function
(`open(marker, "w")`, which creates the file `marker`): what a malicious .ckpt does, harmlessly."""

from __future__ import annotations

from pathlib import Path

import torch

from ae.training.position.checkpoint_read import load


class CreatesAFile:
    """Unpickled, it is `open(marker, "w")`: the pickle names the global `io.open`."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self) -> tuple:
        return (open, (self.marker, "w"))


def crafted_checkpoint(source: Path, out: Path, marker: Path) -> Path:
    """`source` (an ae checkpoint) with a `CreatesAFile(marker)` added, written to `out`."""
    # a file of the repo's own fixtures, which may pickle classes under the modules they moved
    # from (`MOVED_MODULES`)
    ckpt = load(source, trust=True)
    ckpt["payload"] = CreatesAFile(marker)
    torch.save(ckpt, out)
    return out
