"""What an attempt trained of each epoch: the `Trained in epoch` lines of its ranks (written when
an epoch ends or training stops in it), summed over the ranks, so that a user can check after
the fact that a job's attempts together trained every epoch whole."""

from __future__ import annotations

from pathlib import Path

from ae.diagnose.log_files import RunFiles
from ae.log_lines import EPOCH_TRAINED, RECORD_PATTERN


def _rank_samples(files: list[Path]) -> dict[int, int]:
    """{epoch: samples} of one rank's log files (rotations in order)."""
    out: dict[int, int] = {}
    for path in files:
        with open(path, errors="replace") as f:
            for line in f:
                if EPOCH_TRAINED.prefix not in line:
                    continue
                m = RECORD_PATTERN.match(line)
                found = EPOCH_TRAINED.parse(m["message"]) if m else None
                if found:
                    epoch = int(found["epoch"])
                    out[epoch] = out.get(epoch, 0) + int(found["samples"])
    return out


def samples_per_epoch(run: RunFiles) -> dict[str, int]:
    """{epoch (as a JSON key): samples trained in it by every rank of the run together}."""
    total: dict[int, int] = {}
    for rank in sorted(run.debug_logs):
        for epoch, samples in _rank_samples(run.debug_logs[rank]).items():
            total[epoch] = total.get(epoch, 0) + samples
    return {str(epoch): total[epoch] for epoch in sorted(total)}
