"""The lines of `ae-encode` (ae.rank.encode), defined once (re-exported by `ae.log_lines`, where
readers find every format): the plan, each output shard, each rank, the whole job."""

from __future__ import annotations

from logging_cfg.formats import LineFormat

ENCODE_PLAN = LineFormat(
    "Encode plan: {shards} shards, {samples} samples on {ranks} ranks (whole shards); this "
    "rank: {rank_shards} shards, {rank_samples} samples",
    {"shards": "int", "samples": "int", "ranks": "int", "rank_shards": "int",
     "rank_samples": "int"},
)  # fmt: skip
ENCODED_SHARD = LineFormat(
    "Encoded shard {url} -> {out}: {samples} samples",
    {"url": "text", "out": "text", "samples": "int"},
)
ENCODE_RANK_DONE = LineFormat(
    "Encoded {samples} samples of {shards} shards ({bad} bad samples skipped) in {seconds}s",
    {"samples": "int", "shards": "int", "bad": "int", "seconds": "float"},
)
ENCODE_DONE = LineFormat(
    "Encoding done: {samples} of {planned} samples written ({bad} bad samples skipped) to "
    "{shards} shards in {out}; {field} {dtype} {shape} per sample",
    {"samples": "int", "planned": "int", "bad": "int", "shards": "int", "out": "text",
     "field": "word", "dtype": "word", "shape": "word"},
)  # fmt: skip
