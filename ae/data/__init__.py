"""Data: shard specs -> equal batches on every rank, in sub-packages by concern (shards <-
decoding | planning <- stream), the Lightning data module over them in this package's own
modules, and the ae-shards commands (tools/). Imports the core, logging_cfg and forensics.
The map: ae/data/README.md."""
