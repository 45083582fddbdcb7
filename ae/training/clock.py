"""Each rank's clock against rank 0's, measured once when the process group is up.

ae-diagnose orders events of different hosts by their log times (which rank failed first, which
stopped before the others); hosts whose clocks differ by seconds would reorder them. The process
group is the common reference: after a barrier, rank 0 broadcasts its `time.time()`, and each
rank takes the difference to its own clock when the value arrives. That overestimates the offset
by the message's latency, so the smallest of a few rounds is kept, and the duration of the
broadcast as this rank saw it bounds the error. Each rank logs CLOCK_OFFSET in its debug log.
"""

from __future__ import annotations

import socket
import time

import lightning as L
import torch
import torch.distributed as dist
from loguru import logger

from ae.log_lines import CLOCK_OFFSET

ROUNDS = 5


def clock_offset(device: torch.device, rounds: int = ROUNDS) -> tuple[float, float]:
    """(offset of this rank's clock against rank 0's, error bound), in seconds. A collective:
    every rank of the default group calls it."""
    best: tuple[float, float] | None = None
    for _ in range(rounds):
        dist.barrier()
        before = time.time()
        t0 = torch.tensor([before], dtype=torch.float64, device=device)
        dist.broadcast(t0, src=0)
        # .item() waits for the value (an NCCL broadcast returns before it lands): only then
        # has it arrived.
        sent = float(t0.item())
        arrived = time.time()
        found = (arrived - sent, arrived - before)
        if best is None or found[0] < best[0]:
            best = found
    assert best is not None
    return best


class ClockOffset(L.Callback):
    """Measures and logs the offset at setup, once the process group exists."""

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
            return
        offset, error = clock_offset(trainer.strategy.root_device)
        logger.info(
            CLOCK_OFFSET.format(
                offset=f"{offset:+.3f}", host=socket.gethostname(), error=f"{error:.3f}"
            )
        )
