"""Shards as files: tar reading (fast, and Python's `tarfile`), compressed shards, counting a
shard by its tar headers, index sidecars, shard specs, writing shards, WebDataset's key rule,
the bad-data lines and the demo dataset. The lowest layer of ae.data: imports the core alone."""
