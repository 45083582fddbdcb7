"""Entry points, thin: argument parsing -> a call. `launch` (./train_ae.sh, ae-train ->
`ae.job.launch`), `encode` (ae-encode -> `ae.job.encode`), `shards` (ae-shards ->
`ae.data.tools`), and the processes torchrun starts for each rank: `rank_process` (native
output captured from its first line, then `ae.rank.train`) and `encode_rank` (`ae.rank.encode`).
The top layer: may import all."""
