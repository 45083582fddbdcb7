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
ENCODED_NOT = LineFormat(
    "Not encoded: {url} could not be read to its end (see the Bad shard line); {out} is not "
    "written",
    {"url": "text", "out": "text"},
)
ENCODE_SKIPPED = LineFormat(
    "Resuming: {skipped} of {shards} output shards are complete in {out} (whole, indexed, from "
    "this checkpoint and these settings): skipped",
    {"skipped": "int", "shards": "int", "out": "text"},
)
ENCODE_PROGRESS = LineFormat(
    "Encode progress of this rank: {shards} of {rank_shards} shards, {samples} of "
    "{rank_samples} samples, {rate} samples/s, ETA {eta}",
    {"shards": "int", "rank_shards": "int", "samples": "int", "rank_samples": "int",
     "rate": "int", "eta": "word"},
)  # fmt: skip
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
