"""Train an autoencoder on WebDataset shards: one rank, for those who run torchrun themselves.

    torchrun --nproc_per_node=2 train_ae.py --train_shards='data/train-*.tar' ...
    python train_ae.py --help

`./train_ae.sh` does not run this file: its launcher (`ae.cli.launch` -> `ae.job.launch`)
validates the flags, prepares the demo data and starts torchrun over `ae.cli.rank_process`, the
same process this file starts: the rank's native output captured from its first line, then one
rank's flow (ae/rank/train.py): configure logging (per-rank debug log, the shared train log, crash
hooks), parse and validate the config, start the stall watchdog, resolve the shards, build the
data module, the model and the Lightning trainer, fit, and clean up.
"""

import sys

from ae.cli.rank_process import main
from ae.process_end import run_then_exit

if __name__ == "__main__":
    run_then_exit(main, sys.argv[1:])
