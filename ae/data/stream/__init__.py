"""The per-rank stream of batches: the generator stages, the fixed-layout fast path, resampled
shards, DataLoaders and mid-epoch resume, worker read rates, and the stream `ae-encode` reads.
Imports ae.data.shards, ae.data.decoding, ae.data.planning, the core and forensics."""
