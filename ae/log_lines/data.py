"""The lines of a run's data, defined once (re-exported by `ae.log_lines`, where readers find
every format): the files each worker reads and what it yielded, where the shard counts came from,
the split's plan, the validation hold-out, the input field, and bad data (ae.data)."""

from __future__ import annotations

from logging_cfg.formats import LineFormat

PROCESSING_FILES = LineFormat(
    "Processing {n}/{total} files from {split}_shards ({samples} samples planned, epoch {epoch})",
    {"n": "int", "total": "int", "samples": "int", "epoch": "int"},
)
COMPLETED_ITERATION = LineFormat(
    "COMPLETED iteration, total samples: {samples} ({split}, epoch {epoch}, "
    "{errors} data errors, {replaced} replaced)",
    {"samples": "int", "epoch": "int", "errors": "int", "replaced": "int"},
)

# Data plan (ae.data.planning.counts, ae.data.datamodule): where the counts came from, and
# the split.
SHARD_COUNTS = LineFormat(
    "Shard counts {split}_shards: {shards} shards, {samples} samples ({indexed} from index, "
    "{scanned} scanned) {source}",
    {"shards": "int", "samples": "int", "indexed": "int", "scanned": "int", "source": "text"},
)
# While counting lasts more than a few seconds (rank 0 on the console, every rank in its log).
COUNT_PROGRESS = LineFormat(
    "Counting {split}_shards: {done}/{shards} shards of this rank's share, {samples} samples, "
    "{rate} samples/s, ETA {eta}s",
    {"done": "int", "shards": "int", "samples": "int", "rate": "int", "eta": "int"},
)
SHARD_PLAN = LineFormat(
    "Shard plan {split}: {shards} shards, {samples} samples -> {batches} batches x {batch_size} "
    "per rank on {ranks} ranks x {workers} workers ({mode}: {dropped} dropped, {repeated} "
    "repeated); this rank: {rank_samples} samples, worker batches {worker_batches}",
    {"shards": "int", "samples": "int", "batches": "int", "batch_size": "int", "ranks": "int",
     "workers": "int", "dropped": "int", "repeated": "int", "rank_samples": "int"},
)  # fmt: skip
# Without --val_shards (ae.data.planning.holdout), once, rank 0, on the console: what
# validates the run. On a resume `resumed` says the hold-out is the resumed run's (`least`: its
# count, not this run's batch per rank), and `repeats` whether validation repeats some of its
# samples to fill a larger batch per rank; both are empty otherwise.
VALIDATION_HELD_OUT = LineFormat(
    "Validation: {val} of the {total} {unit} of train_shards held out by {by} ({resumed}"
    "--val_fraction={fraction}, at least {least}), the same every epoch{repeats}; training on "
    "the other {train}. --val_shards=SPEC validates on other shards, --val_shards=none on none",
    {"val": "int", "total": "int", "unit": "word", "by": "word", "resumed": "text",
     "fraction": "text", "least": "text", "repeats": "text", "train": "int"},
)  # fmt: skip
VALIDATION_OFF = "Validation off (--val_shards=none): no val loss, no best.ckpt"
# The model input (ae.data.datamodule), once per rank: which field, chosen how, and its shape.
INPUT_FIELD = LineFormat(
    "Input field {field} ({source}): shape {shape}, {detail}",
    {"field": "text", "source": "text", "shape": "text", "detail": "text"},
)
# Images whose channels follow a grayscale first one (--channels=0) while a few more samples'
# headers are in colour (ae.data.input_probe): a WARNING on rank 0, train log and console.
MIXED_MODES = LineFormat(
    "Images: the first is grayscale ({first}), so this run trains 1 channel, but {colour} of "
    "the next {looked} looked at are in colour ({modes}); --channels=3 trains colour",
    {"first": "word", "colour": "int", "looked": "int", "modes": "text"},
)

# Bad data, logged at ERROR (docs/CONTRACT.md: `grep "ERROR.*shard"`). The shard is always named.
BAD_SAMPLE = LineFormat(
    "Bad sample {key} in shard {url}: {reason}",
    {"key": "word", "url": "text", "reason": "text"},
)
BAD_SHARD_READ = LineFormat(
    "Bad shard {url}: {reason} (after sample {key}; {lost} of {planned} planned samples lost)",
    {"url": "text", "reason": "text", "lost": "int", "planned": "int"},
)
BAD_SHARD_SCAN = LineFormat(
    "Bad shard {url}: {reason} (counted {samples} whole samples)",
    {"url": "text", "reason": "text", "samples": "int"},
)
# Which reader a worker slice of a shard took (ae.data.stream.fixed_layout_batches), at DEBUG,
# once per slice and epoch: `columnar` (whole batches gathered from the shard bytes) or
# `general` (sample by sample).
SHARD_PATH = LineFormat(
    "Shard path {path} for {url} samples [{start}, {stop}): {why}",
    {"path": "word", "url": "text", "start": "int", "stop": "int", "why": "text"},
)
# Per rank and split, at the end of the run (WARNING when there were errors).
DATA_ERRORS = LineFormat(
    "Data errors {split}_shards: {bad_samples} bad samples, {bad_shards} bad shard reads, "
    "{replaced} samples replaced",
    {"bad_samples": "int", "bad_shards": "int", "replaced": "int"},
)
