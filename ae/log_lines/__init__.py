"""Greppable log lines, defined once: the writers (callbacks, data) format them with `.format()`,
the reader (`ae-diagnose`) parses them with `.parse()`, so the two cannot drift.

The wording is part of the product contract (docs/CONTRACT.md, its grep table). The record
layout, the file names and FATAL come from `logging_cfg.formats` (which logging_cfg itself
writes with) and are re-exported here, so readers find every format in one module.
"""

from __future__ import annotations

import re

from loguru import logger

from ae.log_lines.data import BAD_SAMPLE as BAD_SAMPLE
from ae.log_lines.data import BAD_SHARD_READ as BAD_SHARD_READ
from ae.log_lines.data import BAD_SHARD_SCAN as BAD_SHARD_SCAN
from ae.log_lines.data import COMPLETED_ITERATION as COMPLETED_ITERATION
from ae.log_lines.data import COUNT_PROGRESS as COUNT_PROGRESS
from ae.log_lines.data import DATA_ERRORS as DATA_ERRORS
from ae.log_lines.data import INPUT_FIELD as INPUT_FIELD
from ae.log_lines.data import MIXED_MODES as MIXED_MODES
from ae.log_lines.data import PROCESSING_FILES as PROCESSING_FILES
from ae.log_lines.data import SHARD_COUNTS as SHARD_COUNTS
from ae.log_lines.data import SHARD_PATH as SHARD_PATH
from ae.log_lines.data import SHARD_PLAN as SHARD_PLAN
from ae.log_lines.data import VALIDATION_HELD_OUT as VALIDATION_HELD_OUT
from ae.log_lines.data import VALIDATION_OFF as VALIDATION_OFF
from ae.log_lines.encode import ENCODE_DONE as ENCODE_DONE
from ae.log_lines.encode import ENCODE_PLAN as ENCODE_PLAN
from ae.log_lines.encode import ENCODE_PROGRESS as ENCODE_PROGRESS
from ae.log_lines.encode import ENCODE_RANK_DONE as ENCODE_RANK_DONE
from ae.log_lines.encode import ENCODE_SKIPPED as ENCODE_SKIPPED
from ae.log_lines.encode import ENCODED_NOT as ENCODED_NOT
from ae.log_lines.encode import ENCODED_SHARD as ENCODED_SHARD
from ae.log_lines.health import CHECKPOINT_REFUSED as CHECKPOINT_REFUSED
from ae.log_lines.health import GAN_STATS as GAN_STATS
from ae.log_lines.health import GAN_STATS_FILE as GAN_STATS_FILE
from ae.log_lines.health import GAN_WARNING as GAN_WARNING
from ae.log_lines.health import LOSS_SPIKE as LOSS_SPIKE
from ae.log_lines.health import NONFINITE as NONFINITE
from ae.log_lines.health import NONFINITE_INPUT as NONFINITE_INPUT
from ae.log_lines.health import NONFINITE_RECEIVED as NONFINITE_RECEIVED
from ae.log_lines.health import NONFINITE_SKIPPED as NONFINITE_SKIPPED
from ae.log_lines.health import NONFINITE_STOP as NONFINITE_STOP
from ae.log_lines.health import NONFINITE_SUMMARY as NONFINITE_SUMMARY
from ae.log_lines.health import ROLLBACK as ROLLBACK
from ae.log_lines.launcher import LAUNCHER_GONE as LAUNCHER_GONE
from ae.log_lines.launcher import RANK_ENDED as RANK_ENDED
from ae.log_lines.launcher import RANK_LAUNCHER_GONE as RANK_LAUNCHER_GONE
from logging_cfg.formats import DEBUG_LOG_FILE as DEBUG_LOG_FILE
from logging_cfg.formats import FATAL as FATAL
from logging_cfg.formats import HEARTBEAT_FILE as HEARTBEAT_FILE
from logging_cfg.formats import LAUNCHER_LOG_FILE as LAUNCHER_LOG_FILE
from logging_cfg.formats import NATIVE_LOG_FILE as NATIVE_LOG_FILE
from logging_cfg.formats import RECORD_FORMAT as RECORD_FORMAT
from logging_cfg.formats import RECORD_PATTERN as RECORD_PATTERN
from logging_cfg.formats import TRAIN_LOG_FILE as TRAIN_LOG_FILE
from logging_cfg.formats import WORKER_ORPHANED as WORKER_ORPHANED
from logging_cfg.formats import LineFormat

# Records bound with main=True are summary lines: they also go to train_<TS>.log and the console.
main_log = logger.bind(main=True)

# `========== EPOCH 0 TRAINING START ==========`, `========== CHECKPOINT SAVE END ==========` ...
MARKER = LineFormat("========== {name} {edge} ==========", {"name": "text", "edge": "word"})


def epoch_marker(epoch: int, stage: str, edge: str) -> str:
    return MARKER.format(name=f"EPOCH {epoch} {stage}", edge=edge)


EPOCH_MARKER_NAME = re.compile(r"EPOCH (?P<epoch>\d+) (?P<stage>TRAINING|VALIDATION)")

PROCESSED_TRAIN = LineFormat(
    "Processed {batches} training batches (epoch {epoch}, {rate} batches/s)",
    {"batches": "int", "epoch": "int", "rate": "float"},
)
# Rank 0, train log and console, by time (`ae.forensics.loop_tracer`: CONSOLE_PROGRESS_*): a
# long epoch says how far it is where no progress bar shows (the launcher's console, SLURM's
# output file); the batch-cadence lines above go to the debug logs.
TRAIN_PROGRESS = LineFormat(
    "Epoch {epoch}: batch {batch} of {batches} ({pct}%), {rate} batches/s, epoch ETA {eta}; "
    "step {step}, loss {loss}",
    {"epoch": "int", "batch": "int", "batches": "word", "pct": "word", "rate": "float",
     "eta": "word", "step": "int", "loss": "word"},
)  # fmt: skip
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
# A run resumed on another number of ranks (a job that lost or gained a node): the checkpoint's
# optimizer carries the LR scaled for the ranks that saved it; rank 0, once, in the train log.
LR_RESCALED = LineFormat(
    "LR re-scaled for {world} ranks at step {step}: effective LR {old} -> {new} (scaled by "
    "{factor}, {mode}); the schedule goes on from there",
    {"world": "int", "step": "int", "old": "float", "new": "float", "factor": "float"},
)
# A run resumed with another LR flag (`--learning_rate`, `--lr_scale`, a group's multiplier):
# LR_RESCALED named ranks that had not changed; rank 0, once, in the train log.
LR_FROM_FLAGS = LineFormat(
    "LR set from the new {flags} at step {step}: effective LR {old} -> {new} (scaled by {factor} "
    "for {world} ranks, {mode}); the schedule goes on from there",
    {"step": "int", "old": "float", "new": "float", "factor": "float", "world": "int"},
)
EFFECTIVE_BATCH = LineFormat(
    "Effective batch: {batch} per device x {world} ranks x {accum} accumulation = {total} "
    "samples per optimizer step",
    {"batch": "int", "world": "int", "accum": "int", "total": "int"},
)
# `batch` of the epoch's `batches` (Lightning's count: those before the resume included) and
# `samples` of the epoch already trained, all ranks together (`ae.training.position`).
RESUMED = LineFormat(
    "Resumed from {path} at step {step} (epoch {epoch}, LR {lr}): batch {batch} of {batches} of "
    "the epoch, {samples} of its samples already trained",
    {"path": "text", "step": "int", "epoch": "int", "lr": "float", "batch": "int",
     "batches": "int", "samples": "int"},
)  # fmt: skip
# Per rank, debug log: what this rank trained of an epoch in this run (attempt), written when the
# epoch ends or training stops in it; `upto` of the epoch's `length` batches (Lightning's count).
# `ae-diagnose --json` sums them per attempt (`samples_per_epoch`).
EPOCH_TRAINED = LineFormat(
    "Trained in epoch {epoch}: {samples} samples in {batches} batches on this rank, up to batch "
    "{upto} of {length}",
    {"epoch": "int", "samples": "int", "batches": "int", "upto": "int", "length": "int"},
)

# A job that restarts after a failure (`--max_restarts`, ae.job.restarts): the launcher's console
# line, and the first line of the new attempt's train log (rank 0). `failed` is the attempt's
# verdict (`rank 1 on node1: error exit: ...`); `previous` the failed attempt's run TS, by which
# ae-diagnose lists the attempts of a job; `nodes` is empty, or, on several nodes whose members
# changed (`--min_nodes`, ae.job.elastic), `; ` and the NODES_CHANGED line.
RESTART = LineFormat(
    "RESTART {attempt}/{max} after {failed} at step {step}; resuming from step {resume} "
    "({checkpoint}), {redone} steps redone{nodes}; previous attempt: run {previous}",
    {"attempt": "int", "max": "int", "failed": "text", "step": "int", "resume": "int",
     "checkpoint": "text", "redone": "int", "previous": "word", "nodes": "text"},
)  # fmt: skip
# The `failed` of a RESTART that no failure caused: torchrun stopped a healthy job to take in a
# node that joined (ae.job.elastic); `ae-diagnose --goodput` counts no steps redone for it.
CHANGE_OF_NODES = "a change of nodes"
# At the end of a job that restarted (the launcher, console), and `ae-diagnose --goodput`'s first
# line: the job's wall time over all its attempts, and where the part not trained effectively
# went (`parts`: `restart 31.2s, detection 1.4s, ...`, what failures cost first).
GOODPUT = LineFormat(
    "Goodput {share}%: {training}s of effective training in {wall}s over {attempts} attempt(s); "
    "the rest: {parts}",
    {"share": "float", "training": "float", "wall": "float", "attempts": "int", "parts": "text"},
)
# `change`: `node1 lost`, `node1 joined`, `node1 lost, node2 joined`; `total` is NNODES; the world
# sizes are the ranks of the attempt before and of this one.
NODES_CHANGED = LineFormat(
    "{change}: going on with {nodes} of {total} nodes (world {before} -> {after})",
    {"change": "text", "nodes": "int", "total": "int", "before": "int", "after": "int"},
)

# --- checkpoints, sampling, preemption (every rank's debug log) -------------------------------
# `========== CHECKPOINT SAVE START ========== step 100 (periodic) -> /run/checkpoints/...`
# `reason`: periodic, timed, final, preemption (a step file a run resumes from), or
# `best, val/loss=0.123456` (best.ckpt: `BEST_SAVE`, never a resume point).
CHECKPOINT_START = LineFormat(
    MARKER.template.format(name="CHECKPOINT SAVE", edge="START")
    + " step {step} ({reason}) -> {path}",
    {"step": "int", "reason": "text", "path": "text"},
)
CHECKPOINT_END = LineFormat(
    MARKER.template.format(name="CHECKPOINT SAVE", edge="END")
    + " step {step} ({reason}): {path}, {size}, {seconds}s",
    {"step": "int", "reason": "text", "path": "text", "size": "text", "seconds": "float"},
)
BEST_SAVE = "best, val/loss={value:.6f}"  # the reason of a best.ckpt save


def saves_step_file(fields: dict[str, str]) -> bool:
    """Whether a parsed CHECKPOINT_START/END line saves a step file (not best.ckpt)."""
    return not fields["reason"].startswith(BEST_SAVE.partition(",")[0])


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
# A stop signal (SIGTERM: preemption, `scancel`, torchrun stopping a failed job; SIGINT: Ctrl-C),
# with the phase and step the rank was in when it came (recorded by the handler), logged once by
# whichever comes first: the rank's watchdog thread (within a second) or the step boundary that
# acts on it -- never by the signal handler itself.
STOP_SIGNAL = LineFormat(
    "Stop signal {signal} received in phase {phase} at step {step}",
    {"signal": "word", "phase": "text", "step": "int"},
)
# A rank that had made no progress for a while when the signal came: it cannot reach the next
# step boundary to save, so it leaves at once.
STOP_SIGNAL_STUCK = LineFormat(
    "Stop signal {signal} after {idle}s without progress in phase {phase} (step {step}): "
    "exiting now, without a checkpoint",
    {"signal": "word", "idle": "float", "phase": "text", "step": "int"},
)
# Its continuation, on the same line: what the main thread was stuck in when the signal came
# (`collective: <what>`: waiting for a peer; `data loading`; `code: <function (file:line)>`).
# Apart, so that lines written before it was added still parse as STOP_SIGNAL_STUCK.
STUCK_MAIN_THREAD = LineFormat("; stuck in {doing}", {"doing": "text"})
# Every rank saved the same step checkpoint after a stop signal (SIGTERM or SIGINT) and stops.
PREEMPTED = LineFormat(
    "PREEMPTED by {signal} at step {step}: checkpoint {path} saved; stopping (LR {lr})",
    {"signal": "word", "step": "int", "path": "text", "lr": "float"},
)

# A validation whose loss is not finite (a validation sample holding NaN/Inf, or the model's
# output): train log, rank 0, once per run (`ae.training.checkpointing`).
VAL_NONFINITE = LineFormat(
    "Validation at step {step}: val/loss={value} is not finite{best}; a validation sample may "
    "hold NaN/Inf (`ae-shards inspect` on the validation shards names them), or the model's "
    "output is not finite",
    {"step": "int", "value": "word", "best": "text"},
)
# The record whose continuation lines are the resolved config as YAML (train log, rank 0).
RESOLVED_CONFIG = "Resolved config:"
# The rank header's first line: where the rank runs (a rank that dies before its first heartbeat
# is still located by it).
RANK_PROCESS = LineFormat("pid={pid} host={host} python={python}", {"pid": "int"})
# Each rank of a multi-process run, once the process group is up: its clock against rank 0's
# (`ae.training.clock`); ae-diagnose subtracts it from the rank's times.
CLOCK_OFFSET = LineFormat(
    "Clock offset {offset}s against rank 0 (host {host}, measured to {error}s)",
    {"offset": "float", "host": "word", "error": "float"},
)
# Rank 0, once the run reached its end: the launcher reads it when a stop signal came as the run
# ended (nothing left to save, nothing to requeue). `limit`: which one ended it,
# ` (--max_epochs=3 reached)` or ` (--max_steps=20 reached)`; empty when neither did (a user
# LightningModule that set `trainer.should_stop`), and in logs of versions before it.
TRAINING_FINISHED = LineFormat(
    "Training finished at step {step}{limit}", {"step": "int", "limit": "text"}
)
# Last line of a rank that left `main` on its own: 0 after training, 2 after a user mistake.
RANK_EXIT = LineFormat("Rank exiting with code {code}: {why}", {"code": "int", "why": "text"})

# --- resource limits (ae.job.preflight, ae.training.checkpoint_files, ae.rank.train) -----------
# A write that found its filesystem full (ENOSPC), the partial file already removed; the rank
# exits with code 28 after it. `what`: checkpoint, sample grid, log, cache.
DISK_FULL = LineFormat(
    "Disk full: no space left on device writing {what} {path} ({free} free of {total}); {fix}",
    {"what": "text", "path": "text", "free": "text", "total": "text", "fix": "text"},
)
# The watchdog, at a STALL in data loading with /dev/shm near full: the workers block (or die by
# SIGBUS) allocating the batches they hand over there.
SHM_NEAR_FULL = LineFormat(
    "Shared memory near full while stalled in {phase}: /dev/shm {free} MB free of {total} MB; "
    "{fix}",
    {"phase": "text", "free": "float", "total": "float", "fix": "text"},
)
# A limit that is tight but can work (one that cannot stops the run: ResourceLimitError).
RESOURCE_TIGHT = LineFormat("Resource tight: {problem}", {"problem": "text"})

# --- forensics (ae.forensics.watchdog, logging_cfg hooks, ae.forensics.faults) -------------
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
# Flight Recorder dumps (ae.forensics.flight_recorder): each rank's recent collectives, as JSON in
# the logs folder, rewritten at its first STALL report, when it fails or is stopped, and when
# `ae-diagnose --dump` leaves the request file (the watchdog looks for it at every check).
COLLECTIVES_FILE = LineFormat("collectives_rank{rank}_{ts}.json", {"rank": "int"})
DUMP_REQUEST_FILE = LineFormat("dump_request_{ts}")
# A rank on a torch whose Flight Recorder records NCCL's collectives only
# (ae.forensics.flight_recorder).
OLD_TORCH_RECORDER = LineFormat(
    "torch {version} is older than {floor}: its Flight Recorder does not record gloo collectives, "
    "so ae-diagnose cannot name a collective mismatch on gloo (NCCL's are recorded)",
    {"version": "word", "floor": "word"},
)
COLLECTIVES_DUMPED = LineFormat(
    "Collectives dumped ({reason}): {entries} entries to {file}",
    {"reason": "text", "entries": "int", "file": "text"},
)
# A rank stalled for --hang_timeout seconds (ae.forensics.watchdog), after its final STALL report:
# it exits with HANG_EXIT_CODE, so the job restarts (--max_restarts) or ends with the verdict.
HANG_TIMEOUT = LineFormat(
    "HANG TIMEOUT: no progress for {idle}s in phase {phase} (step {step}), past --hang_timeout="
    "{timeout}s; exiting with code {code}",
    {"idle": "float", "phase": "text", "step": "int", "timeout": "float", "code": "int"},
)
HANG_EXIT_CODE = 124  # as coreutils' `timeout`: distinct from an exception (1) and a user error (2)
# A stall that ended without progress: the rank left it for teardown (a peer died, torchrun's
# SIGTERM, an exception on its way out). INFO, debug log only: nothing was resolved, and the
# stall stays what the rank was doing (`ae-diagnose` keeps it open).
STALL_ENDED = LineFormat(
    "STALL ended without progress after {idle}s in phase {phase} (epoch {epoch}, step {step}): "
    "the rank tears down ({why})",
    {"idle": "float", "phase": "text", "epoch": "int", "step": "int", "why": "text"},
)
# Written by ae.forensics.faults (tests, broken runs on purpose) right before acting. `step`: the
# fault's own (`train`: the global step, the optimizer steps done, as `step=N` of AE_FAULT);
# `effect`: empty, or for a loss fault `: the loss of optimizer step N+1 turns NaN`, the step its
# NONFINITE line names.
FAULT_INJECTED = LineFormat(
    "FAULT injected: {action}@{point} at step {step} (rank {rank}){effect}",
    {"step": "int", "rank": "int", "effect": "text"},
)

# --- stragglers (ae.forensics.stragglers; scores from ae.stragglers) --------------------------
# Written by the detecting rank (rank 0) to the train log and its debug log, and copied by the slow
# rank into its own debug log. `cause` is `data` or `compute`; `evidence` says why, in figures.
STRAGGLER = LineFormat(
    "STRAGGLER rank {rank}: {score}x the median own time per step over {window}s; "
    "cause {cause}: {evidence}",
    {"rank": "int", "score": "float", "window": "float", "cause": "word", "evidence": "text"},
)
STRAGGLER_RESOLVED = LineFormat(
    "STRAGGLER RESOLVED rank {rank} after {seconds}s: now {score}x the median own time per step",
    {"rank": "int", "seconds": "float", "score": "float"},
)
# Per epoch, rank 0, train log: the spread of the ranks' own time per step (data wait + compute,
# without the time spent waiting for the other ranks) and of their data wait.
EPOCH_STEP_TIMES = LineFormat(
    "Step times epoch {epoch} ({ranks} ranks): own time per step min {own_min} / median "
    "{own_median} / max {own_max} ms (slowest rank {slowest}); data wait min {data_min} / median "
    "{data_median} / max {data_max}% of own time",
    {"epoch": "int", "ranks": "int", "own_min": "float", "own_median": "float",
     "own_max": "float", "slowest": "int", "data_min": "float", "data_median": "float",
     "data_max": "float"},
)  # fmt: skip
# Right after it, rank 0, train log and console: the epoch's training throughput (samples per
# second over the step clocks: validation and the time between epochs left out), the slowest
# rank's split of a step, and what bounds the job (`ae.stragglers`: `input-bound`, with what would
# feed it faster, `compute-bound` or `sync-bound`).
THROUGHPUT = LineFormat(
    "Throughput epoch {epoch}: {samples_per_s} samples/s, {step_ms} ms per step ({split}); "
    "{verdict}",
    {"epoch": "int", "samples_per_s": "float", "step_ms": "float", "split": "text",
     "verdict": "text"},
)  # fmt: skip

# Heartbeat file per rank in the logs folder, rewritten atomically every few seconds by the
# watchdog thread: one JSON object with exactly HEARTBEAT_FIELDS (times are Unix seconds).
# Readers need only HEARTBEAT_BASE_FIELDS: heartbeats of runs before the step times lack the rest.
HEARTBEAT_BASE_FIELDS = (
    "rank", "world_size", "pid", "host", "phase", "epoch", "step", "time", "last_progress",
    "idle_s", "rss_mb", "workers", "stalled", "state",
)  # fmt: skip
# `timing`: {"recent": window, "epoch": window, "run": {steps, data_s}} with window = {window_s,
# steps, step_ms, own_ms, data_ms, compute_ms, sync_ms} (per optimizer step) or null, and `run` the
# rank's optimizer steps and data wait in seconds since it started; `data_workers`: [{worker, pid,
# shard, mb_per_s, batch_ms, batches}]; `stragglers`: the detecting rank's episodes, [{rank, score,
# cause, since, line, resolved}] (`resolved`: null while it lasts, else the RESOLVED line);
# `resources`: RESOURCE_FIELDS (`ae.forensics.resources`; MB, null where the kernel does not say);
# `main`: what the main thread is in, `collective: <what>`, `data loading` or `code: <function
# (file:line)>` (null in the last beat, written by the main thread itself).
HEARTBEAT_FIELDS = (
    *HEARTBEAT_BASE_FIELDS, "timing", "data_workers", "stragglers", "resources", "main"
)  # fmt: skip
RESOURCE_FIELDS = (
    "shm_free_mb", "shm_total_mb", "disk_free_mb", "disk_total_mb", "mem_available_mb",
    "mem_total_mb", "cgroup_limit_mb", "oom_kills", "oom_kills_at_start", "open_fds", "fd_limit",
)  # fmt: skip
