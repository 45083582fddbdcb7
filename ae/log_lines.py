"""Greppable log lines, defined once: the writers (callbacks, data) format them with `.format()`,
the reader (`ae-diagnose`) parses them with `.parse()`, so the two cannot drift.

The SPEC fixes the wording; see the grep table in SPEC.md and README.md.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass, field
from typing import Any

from loguru import logger

# Every record line: `2026-11-21 22:15:38.039 | INFO     | [Rank 1/2 Worker 0/2] message`.
# RECORD_FORMAT is the loguru format the sinks use; RECORD_PATTERN reads such lines back.
RECORD_FORMAT = "{time:YYYY-MM-DD HH:mm:ss.SSS} | {level: <8} | {extra[tag]} {message}"
RECORD_PATTERN = re.compile(
    r"^(?P<time>\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d{3}) \| (?P<level>[A-Z]+)\s*\| "
    r"\[Rank (?P<rank>\d+)/(?P<world>\d+)(?: Worker (?P<worker>\d+)/(?P<workers>\d+))?\] "
    r"(?P<message>.*)$"
)

# Records bound with main=True are summary lines: they also go to train_<TS>.log and the console.
main_log = logger.bind(main=True)

_FIELD_PATTERNS = {
    "int": r"-?\d+",
    "float": r"[-+]?(?:\d+\.?\d*(?:[eE][-+]?\d+)?|nan|inf)",
    "word": r"\S+",
    "text": r".*?",
}


@dataclass(frozen=True)
class LineFormat:
    """A message template like `Training step {step}, loss={loss}` with typed fields."""

    template: str
    types: dict[str, str] = field(default_factory=dict)

    def format(self, **values: Any) -> str:
        return self.template.format(**values)

    @functools.cached_property
    def regex(self) -> re.Pattern[str]:
        parts = re.split(r"\{(\w+)(?::[^}]*)?\}", self.template)
        out = []
        for i, part in enumerate(parts):
            if i % 2 == 0:
                out.append(re.escape(part))
                continue
            pattern = _FIELD_PATTERNS[self.types.get(part, "word")]
            if pattern == _FIELD_PATTERNS["text"] and i == len(parts) - 2 and not parts[-1]:
                pattern = ".*"  # a text field that ends the line takes the rest of it
            out.append(f"(?P<{part}>{pattern})")
        return re.compile("".join(out))

    def parse(self, line: str) -> dict[str, str] | None:
        m = self.regex.search(line)
        return None if m is None else m.groupdict()

    @functools.cached_property
    def prefix(self) -> str:
        """The literal text before the first field: a cheap substring test before `.parse()`."""
        return self.template.split("{", 1)[0]


# `========== EPOCH 0 TRAINING START ==========`, `========== CHECKPOINT SAVE END ==========` ...
MARKER = LineFormat("========== {name} {edge} ==========", {"name": "text", "edge": "word"})


def epoch_marker(epoch: int, stage: str, edge: str) -> str:
    return MARKER.format(name=f"EPOCH {epoch} {stage}", edge=edge)


EPOCH_MARKER_NAME = re.compile(r"EPOCH (?P<epoch>\d+) (?P<stage>TRAINING|VALIDATION)")

PROCESSING_FILES = LineFormat(
    "Processing {n}/{total} files from {split}_shards ({samples} samples planned, epoch {epoch})",
    {"n": "int", "total": "int", "samples": "int", "epoch": "int"},
)
COMPLETED_ITERATION = LineFormat(
    "COMPLETED iteration, total samples: {samples} ({split}, epoch {epoch}, "
    "{errors} data errors, {replaced} replaced)",
    {"samples": "int", "epoch": "int", "errors": "int", "replaced": "int"},
)

# Data plan (ae.shard_counts, ae.datamodule): where the counts came from, and the split.
SHARD_COUNTS = LineFormat(
    "Shard counts {split}_shards: {shards} shards, {samples} samples ({indexed} from index, "
    "{scanned} scanned) {source}",
    {"shards": "int", "samples": "int", "indexed": "int", "scanned": "int", "source": "text"},
)
SHARD_PLAN = LineFormat(
    "Shard plan {split}: {shards} shards, {samples} samples -> {batches} batches x {batch_size} "
    "per rank on {ranks} ranks x {workers} workers ({mode}: {dropped} dropped, {repeated} "
    "repeated); this rank: {rank_samples} samples, worker batches {worker_batches}",
    {"shards": "int", "samples": "int", "batches": "int", "batch_size": "int", "ranks": "int",
     "workers": "int", "dropped": "int", "repeated": "int", "rank_samples": "int"},
)  # fmt: skip

# Bad data, logged at ERROR (SPEC: `grep "ERROR.*shard"`). The shard is always named.
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
# Per rank and split, at the end of the run (WARNING when there were errors).
DATA_ERRORS = LineFormat(
    "Data errors {split}_shards: {bad_samples} bad samples, {bad_shards} bad shard reads, "
    "{replaced} samples replaced",
    {"bad_samples": "int", "bad_shards": "int", "replaced": "int"},
)
PROCESSED_TRAIN = LineFormat(
    "Processed {batches} training batches (epoch {epoch}, {rate} batches/s)",
    {"batches": "int", "epoch": "int", "rate": "float"},
)
TRAIN_STEP = LineFormat(
    "Training step {step}, loss={loss}{detail}",
    {"step": "int", "loss": "float", "detail": "text"},
)
VAL_STEP = LineFormat(
    "Validation step {step}, loss={loss}{detail}",
    {"step": "int", "loss": "float", "detail": "text"},
)

# --- training recipe (train log, rank 0) ------------------------------------------------------
EFFECTIVE_LR = LineFormat(
    "Base LR: {base}, Effective LR (scaled by {factor}, {mode}): {lr}",
    {"base": "float", "factor": "float", "lr": "float"},
)
EFFECTIVE_BATCH = LineFormat(
    "Effective batch: {batch} per device x {world} ranks x {accum} accumulation = {total} "
    "samples per optimizer step",
    {"batch": "int", "world": "int", "accum": "int", "total": "int"},
)
RESUMED = LineFormat(
    "Resumed from {path} at step {step} (epoch {epoch}, LR {lr})",
    {"path": "text", "step": "int", "epoch": "int", "lr": "float"},
)

# --- checkpoints, sampling, preemption (every rank's debug log) -------------------------------
# `========== CHECKPOINT SAVE START ========== step 100 (periodic) -> /run/checkpoints/...`
CHECKPOINT_START = LineFormat(
    MARKER.template.format(name="CHECKPOINT SAVE", edge="START")
    + " step {step} ({reason}) -> {path}",
    {"step": "int", "path": "text"},
)
CHECKPOINT_END = LineFormat(
    MARKER.template.format(name="CHECKPOINT SAVE", edge="END")
    + " step {step} ({reason}): {path}, {size}, {seconds}s",
    {"step": "int", "path": "text", "size": "text", "seconds": "float"},
)
SAMPLING_START = LineFormat(
    MARKER.template.format(name="SAMPLING", edge="START")
    + " step {step}: {batches} batch(es) x {batch_size} per device, memory {memory}",
    {"step": "int", "batches": "int", "batch_size": "int", "memory": "text"},
)
SAMPLING_END = LineFormat(
    MARKER.template.format(name="SAMPLING", edge="END")
    + " step {step}: {outcome}, {seconds}s, memory {memory}",
    {"step": "int", "outcome": "text", "seconds": "float", "memory": "text"},
)
SAMPLING_OOM = LineFormat(
    "SAMPLING OOM at step {step} with batch {batch_size} per device: {error}; memory at failure "
    "{at_failure}, after freeing {after}; {action}",
    {"step": "int", "batch_size": "int", "error": "text", "at_failure": "text", "after": "text"},
)
PREEMPTED = LineFormat(
    "PREEMPTED by SIGTERM at step {step}: checkpoint {path} saved; stopping (LR {lr})",
    {"step": "int", "path": "text", "lr": "float"},
)

# The record whose continuation lines are the resolved config as YAML (train log, rank 0).
RESOLVED_CONFIG = "Resolved config:"
# Last line of a rank that left `main` on its own: 0 after training, 2 after a user mistake.
RANK_EXIT = LineFormat("Rank exiting with code {code}: {why}", {"code": "int", "why": "text"})

# --- forensics (ae.watchdog, logging_cfg hooks, ae.fault_injection) ------------------------------
# The one-line stall WARNING (also in train_<TS>.log); `frame` is the innermost frame of the main
# thread, `function (file:line)`; `collective` is `no` or `yes (<what>)` -- a rank blocked in a
# collective is usually waiting for the rank that stalls, not the cause.
STALL = LineFormat(
    "STALL detected: no progress for {idle}s in phase {phase} (epoch {epoch}, step {step}); "
    "report {report}; main thread in {frame}; collective wait: {collective}",
    {"idle": "float", "phase": "text", "epoch": "int", "step": "int", "report": "int",
     "frame": "text", "collective": "text"},
)  # fmt: skip
# First line of the full report (debug log only); stacks and process table follow on more lines.
STALL_REPORT = LineFormat(
    "STALL report {report}: rank {rank}, pid {pid}, idle {idle}s, phase {phase}",
    {"report": "int", "rank": "int", "pid": "int", "idle": "float", "phase": "text"},
)
STALL_RESOLVED = LineFormat(
    "STALL RESOLVED after {idle}s in phase {phase} (epoch {epoch}, step {step}); now {now}",
    {"idle": "float", "phase": "text", "epoch": "int", "step": "int", "now": "text"},
)
# Uncaught exception, CRITICAL, traceback on the following lines. `where`: `main thread`,
# `thread <name>`, or `dataloader worker <w>/<K>`.
FATAL = LineFormat(
    "FATAL uncaught exception {exc_type} in {where}: {message}",
    {"exc_type": "word", "where": "text", "message": "text"},
)
# Written by ae.fault_injection (tests, broken runs on purpose) right before acting.
FAULT_INJECTED = LineFormat(
    "FAULT injected: {action}@{point} at step {step} (rank {rank})",
    {"step": "int", "rank": "int"},
)

# Files of a run in the logs folder (rotated ones get `.1`, `.2` ... appended).
TRAIN_LOG_FILE = LineFormat("train_{ts}.log")
DEBUG_LOG_FILE = LineFormat("debug_rank{rank}_{ts}.log", {"rank": "int"})
NATIVE_LOG_FILE = LineFormat("native_rank{rank}_{ts}.log", {"rank": "int"})
# Heartbeat file per rank in the logs folder, rewritten atomically every few seconds by the
# watchdog thread: one JSON object with exactly HEARTBEAT_FIELDS (times are Unix seconds).
HEARTBEAT_FILE = LineFormat("heartbeat_rank{rank}_{ts}.json", {"rank": "int"})
HEARTBEAT_FIELDS = (
    "rank", "world_size", "pid", "host", "phase", "epoch", "step", "time", "last_progress",
    "idle_s", "rss_mb", "workers", "stalled", "state",
)  # fmt: skip
