"""`ae-encode CKPT SPEC OUT_DIR`: encode every sample of a shard set with a trained checkpoint.

    ae-encode runs/ae/checkpoints/last.ckpt 'data/train-*.tar' data/latents \\
        [--batch_size 64] [--field latent.npy] [--dtype float32|float16] [--keep_fields cls,json]

Writes one output shard per input shard, under the same file name in OUT_DIR, holding the same
sample keys: the latent as `<key>.<field>` (an `.npy` of the checkpoint's latent shape, EMA
weights when the run kept an average), plus the input fields named by `--keep_fields` (`all`:
every field), and each shard's index sidecar: a dataset `ae` itself trains on. Runs on 1..N
processes through torchrun like training (`--devices`, NNODES/NODE_RANK for several nodes), with
the same per-rank logs in OUT_DIR/logs/, the stall watchdog, and `ae-diagnose OUT_DIR/logs`.
Ranks get whole shards, balanced by sample count, so every sample is encoded exactly once.
Run again into the same OUT_DIR, it skips the outputs an earlier run of the same checkpoint and
settings completed (`ae.job.encode_outputs`); `--overwrite` encodes everything again.

Everything checkable without the model (the arguments, the output names, the checkpoint file)
is checked before any process starts (`ae.job.encode`); bad input exits 2 with one message.
Each rank runs `ae.rank.encode`; a failure there is reported as training's (`ae.job.outcome`).
"""

from __future__ import annotations

import sys

import logging_cfg
from ae.job.encode import launch
from ae.job.encode_args import help_text


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "--help" in argv or "-h" in argv:
        # Text to read, not a log line: no clock time in front of it.
        sys.stdout.write(help_text() + "\n")
        return 0
    logging_cfg.configure_console()
    return launch(argv)


if __name__ == "__main__":
    sys.exit(main())
