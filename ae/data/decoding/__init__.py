"""Sample bytes -> float32 arrays: the input field and shape, and images in every size and mode
(Pillow). Imports ae.data.shards and the core."""
