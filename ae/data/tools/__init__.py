"""The commands of `ae-shards` (their arguments: `ae/cli/shards.py`): write, index, inspect and
bench shards. Imports the rest of ae.data, the core and logging_cfg."""
