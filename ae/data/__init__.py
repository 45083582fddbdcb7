"""Data: shard specs -> URLs, tar reading and decoding, sample counts and index sidecars, the
even split across ranks and workers (the plan), the stream of batches, DataLoaders, mid-epoch
resume, shard writing, and the demo dataset. Imports the core, logging_cfg and forensics."""
