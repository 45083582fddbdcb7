"""Which samples each (rank, worker) slot reads: sample counts per shard, the even split of an
epoch, validation held out of the train shards, the shuffle buffer's order. Imports
ae.data.shards and the core; never decodes a sample."""
