"""Entry points: `launch` (./train_ae.sh, ae-train: validate, then torchrun; with `topology`,
`run_folder`, `supervise`, `outcome`, and `torchrun`, torchrun with its output in a file), `rank`
(one rank of a run, top to bottom), `rank_process` (what each rank's process runs: native output
captured from its first line, then `rank`), `shards` (ae-shards). The top layer: may import
all."""
