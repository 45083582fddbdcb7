"""Shared rules: straggler scores, applied by the writer (`ae.forensics.stragglers`) and the
reader (`ae.diagnose.stragglers`): which rank is slow, by how much, whether it waits for data;
and what bounds the whole job (input, compute or sync: its last section).

Each rank measures, per optimizer step, its *own time*: the time it waits for its next batch
(data) plus the time of its own work (compute), without the time it waits for the other ranks in
collectives (sync). In synchronous DDP every rank runs at the slowest one's pace, so their step
times are all alike; their own times are not. A rank's score is its own time per step over the
recent window divided by the median of the other ranks' (1.0 = median). Leaving the rank out
of its own baseline changes nothing on a large job and is what makes 2 ranks readable: there
the median of all is the mean of the two, and a rank 2x slower than its peer would score 1.33.
A score above `--straggler_factor` for `--straggler_window` seconds makes a straggler (the
detector on rank 0, `ae.forensics.stragglers`). Its cause is the part of its own time that
exceeds the others' median most: `data` (a starved dataloader, slow storage) or `compute` (a
slow or throttled device, a busy CPU).

The figures come from the heartbeat files (`timing` and `data_workers`, written by
`ae.forensics.heartbeat`); the detector and `ae-diagnose` both judge with the functions here, so
they cannot disagree. Torch-free: `ae-diagnose` imports it.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, fields
from typing import Any

from ae.log_lines import THROUGHPUT

MIN_STEPS = 5  # a rank with fewer optimizer steps in its recent window is not scored
RECENT_S = 30.0  # the recent window, unless --straggler_window is shorter
CAUSES = ("data", "compute")
# A data-bound rank whose slowest worker makes a batch faster than the rank waits for one: the
# time is lost outside the workers' reading (their processes stopped or short of CPU between
# batches, or the hand-over to the rank).
NOT_READING = "its workers' reading does not explain the wait (stopped or CPU-starved workers?)"


def recent_window_s(straggler_window: float) -> float:
    """The recent window of the step times: 30 s, or the straggler window when shorter (a short
    window is meant to react fast)."""
    return min(RECENT_S, straggler_window)


@dataclass(frozen=True)
class Window:
    """Per optimizer step over a window of steps, in milliseconds."""

    window_s: float
    steps: int
    step_ms: float  # wall time per step: own + sync
    own_ms: float  # data + compute
    data_ms: float  # waiting for the next batch
    compute_ms: float  # own work: forward, backward, optimizer step
    sync_ms: float  # waiting for the other ranks (all-reduce, per-step broadcast), bookkeeping

    @property
    def data_pct(self) -> float:
        return 100 * self.data_ms / self.own_ms if self.own_ms > 0 else 0.0

    @classmethod
    def from_json(cls, raw: Any) -> Window | None:
        if not isinstance(raw, dict):
            return None
        names = [f.name for f in fields(cls)]
        try:
            return cls(
                float(raw["window_s"]), int(raw["steps"]), *(float(raw[k]) for k in names[2:])
            )
        except (KeyError, TypeError, ValueError):
            return None


@dataclass(frozen=True)
class WorkerRate:
    """A dataloader worker of a rank: its current shard and how fast it reads it."""

    worker: int
    pid: int
    shard: str | None
    mb_per_s: float | None  # bytes read from the current shard / time spent producing batches
    batch_ms: float | None  # time to produce a batch (moving average)
    batches: int

    @classmethod
    def from_json(cls, raw: Any) -> WorkerRate | None:
        try:
            return cls(
                int(raw["worker"]), int(raw["pid"]), raw.get("shard"),
                _opt_float(raw.get("mb_per_s")), _opt_float(raw.get("batch_ms")),
                int(raw.get("batches", 0)),
            )  # fmt: skip
        except (KeyError, TypeError, ValueError, AttributeError):
            return None


def _opt_float(x: Any) -> float | None:
    return None if x is None else float(x)


@dataclass(frozen=True)
class RankTiming:
    rank: int
    recent: Window | None
    workers: tuple[WorkerRate, ...] = ()

    @classmethod
    def from_heartbeat(cls, raw: dict[str, Any]) -> RankTiming | None:
        """From a heartbeat record; None when it has no step times (an older heartbeat)."""
        timing = raw.get("timing")
        if not isinstance(timing, dict):
            return None
        workers = [WorkerRate.from_json(w) for w in raw.get("data_workers") or []]
        return cls(
            int(raw["rank"]),
            Window.from_json(timing.get("recent")),
            tuple(w for w in workers if w is not None),
        )


@dataclass(frozen=True)
class Judgement:
    rank: int
    score: float
    cause: str  # data or compute
    evidence: str  # the figures behind the cause, in words


def _recent(timings: dict[int, RankTiming]) -> dict[int, Window]:
    """The ranks' recent windows that have at least MIN_STEPS optimizer steps."""
    return {
        r: t.recent
        for r, t in sorted(timings.items())
        if t.recent is not None and t.recent.steps >= MIN_STEPS
    }


def _median_of_others(rank: int, windows: dict[int, Window], key: str) -> float:
    """The median of the other ranks' figure; of an even number of them, the lower middle one
    (a real rank's figure: with 3 ranks, one slow, the other two still score 1.0)."""
    return statistics.median_low(getattr(w, key) for r, w in windows.items() if r != rank)


def scores(timings: dict[int, RankTiming]) -> dict[int, float]:
    """Own time per step of each rank over the median of the other ranks' (those with at least
    MIN_STEPS steps in their recent window; two at least, else no scores)."""
    windows = _recent(timings)
    if len(windows) < 2:
        return {}
    out = {}
    for rank, window in windows.items():
        median = _median_of_others(rank, windows, "own_ms")
        if median > 0:
            out[rank] = window.own_ms / median
    return out


def judge(rank: int, timings: dict[int, RankTiming]) -> Judgement | None:
    """Score and cause of `rank` against the others; None when it cannot be scored. The cause
    is the part of its own time (data or compute) that exceeds the others' median most."""
    score = scores(timings).get(rank)
    if score is None:
        return None
    windows = _recent(timings)
    mine = windows[rank]
    data_median = _median_of_others(rank, windows, "data_ms")
    compute_median = _median_of_others(rank, windows, "compute_ms")
    if mine.data_ms - data_median >= mine.compute_ms - compute_median:
        others = [w for r, t in timings.items() if r != rank for w in t.workers]
        evidence = f"{mine.data_pct:.0f}% of it waiting for data"
        if reader := _slowest_worker(timings[rank].workers):
            evidence += f"; {_worker_text(reader, others)}"
            if (reader.batch_ms or 0.0) < mine.data_ms:
                evidence += f"; {NOT_READING}"
        return Judgement(rank, score, "data", evidence)
    evidence = (
        f"compute {mine.compute_ms:.1f} ms per step (median {compute_median:.1f} ms); "
        f"{mine.data_pct:.0f}% of it waiting for data"
    )
    return Judgement(rank, score, "compute", evidence)


def _slowest_worker(workers: tuple[WorkerRate, ...]) -> WorkerRate | None:
    timed = [w for w in workers if w.batch_ms is not None]
    return max(timed, key=lambda w: w.batch_ms or 0.0) if timed else None


def _worker_text(w: WorkerRate, others: list[WorkerRate]) -> str:
    text = (
        f"worker {w.worker} reads {w.shard or '?'} at {_mb(w.mb_per_s)}, "
        f"{w.batch_ms or 0.0:.1f} ms per batch"
    )
    rates = [o.mb_per_s for o in others if o.mb_per_s is not None]
    times = [o.batch_ms for o in others if o.batch_ms is not None]
    if rates and times:
        rate, ms = statistics.median(rates), statistics.median(times)
        text += f" (other ranks' workers {_mb(rate)}, {ms:.1f} ms)"
    return text


def _mb(rate: float | None) -> str:
    if rate is None:
        return "? MB/s"
    return f"{rate:.2f} MB/s" if rate < 10 else f"{rate:.0f} MB/s"


# --- the job's bound -------------------------------------------------------------------------
# Where a job's step time goes, and what bounds it (data, compute or sync), with the advice that
# follows: the train log's `Throughput epoch` line (`ae.forensics.loop_tracer`, from the epoch's
# step clocks of every rank) and `ae-diagnose` (from the heartbeats' windows) name the same bound.
# In synchronous DDP every rank steps at the pace of the slowest one, so the job's bound is that
# of the rank with the longest own time: when it waits for its batches half of its own time or
# more, more compute would not speed the job up; feeding it would.

# A rank that waits for its batches this share of its own time (or more) is input-bound: its
# workers do not keep up. Below it the step's own work (or the wait for the others) is the cost.
INPUT_BOUND_PCT = 50.0
BOUNDS = ("input", "compute", "sync")


@dataclass(frozen=True)
class RankSplit:
    """A rank's steps over a span (an epoch, a heartbeat window), in milliseconds per step."""

    rank: int
    data_ms: float  # waiting for the next batch
    compute_ms: float  # its own forward, backward and optimizer step
    sync_ms: float  # waiting for the other ranks, and the bookkeeping between steps

    @property
    def own_ms(self) -> float:
        return self.data_ms + self.compute_ms

    @property
    def step_ms(self) -> float:
        return self.own_ms + self.sync_ms

    @property
    def data_pct(self) -> float:
        return 100 * self.data_ms / self.own_ms if self.own_ms > 0 else 0.0


@dataclass(frozen=True)
class Bound:
    rank: int  # the rank that sets the pace (the longest own time)
    bound: str  # input | compute | sync
    split: RankSplit
    words: str  # the bound and the figures behind it, in words


def bound_of(splits: list[RankSplit]) -> Bound | None:
    """What bounds the job: the pace-setting rank's largest part. `input` once its data wait
    reaches INPUT_BOUND_PCT of its own time; else `compute`, or `sync` when waiting for the
    others (and the work between steps) outweighs its own compute. None without a timed rank."""
    timed = [s for s in splits if s.own_ms > 0]
    if not timed:
        return None
    pace = max(timed, key=lambda s: s.own_ms)
    who = f"rank {pace.rank}" if len(splits) > 1 else "the rank"
    if pace.data_pct >= INPUT_BOUND_PCT:
        words = f"input-bound: {who} waits for data {pace.data_pct:.0f}% of its own time"
        return Bound(pace.rank, "input", pace, words)
    if pace.sync_ms > pace.compute_ms:
        words = (
            f"sync-bound: {who} waits for the other ranks (the all-reduce) and between steps "
            f"{100 * pace.sync_ms / pace.step_ms:.0f}% of the step"
        )
        return Bound(pace.rank, "sync", pace, words)
    words = f"compute-bound: {who} waits for data {pace.data_pct:.0f}% of its own time"
    return Bound(pace.rank, "compute", pace, words)


def input_advice(num_workers: int | None, local_ranks: int | None, cpus: int | None) -> str:
    """What feeds an input-bound rank faster, from its loader settings where they are known.
    Workers past the CPUs still help while they wait on storage (a remote or cold read), not
    while they decode: the advice says which is which rather than guess."""
    if num_workers == 0:
        return (
            "the rank reads and decodes every batch itself (--num_workers=0): give it workers, "
            "--num_workers=2 or more"
        )
    bench = "`ae-shards bench SPEC` measures the data alone"
    if num_workers is not None and local_ranks and cpus and num_workers * local_ranks >= cpus:
        return (
            f"the workers ({num_workers} per rank x {local_ranks} ranks) already fill the {cpus} "
            "CPUs: "
            "more --num_workers helps only while they wait on storage; decoding gets faster "
            f"with cheaper samples (smaller images, pre-encoded shards) or more CPUs; {bench}"
        )
    now = ""
    if num_workers is not None:
        now = f" (now {num_workers} per rank"
        now += f", {cpus} CPUs for {local_ranks} ranks here)" if local_ranks and cpus else ")"
    return f"raise --num_workers{now}, or make decoding cheaper; {bench}"


def split_words(bound: Bound, ranks: int) -> str:
    """`slowest rank 1: data wait 75.3, compute 7.4, sync 4.0 ms` (without `slowest rank N` on
    one rank)."""
    s = bound.split
    who = f"slowest rank {bound.rank}: " if ranks > 1 else ""
    return f"{who}data wait {s.data_ms:.1f}, compute {s.compute_ms:.1f}, sync {s.sync_ms:.1f} ms"


def verdict_words(
    bound: Bound, num_workers: int | None, local_ranks: int | None, cpus: int | None
) -> str:
    """The bound in words, with the advice when the input is what bounds the job."""
    if bound.bound == "input":
        return f"{bound.words}; {input_advice(num_workers, local_ranks, cpus)}"
    return bound.words


def epoch_line(
    epoch: int,
    rows: list[tuple[float, float, float, float]],
    samples_per_step: int,
    *,
    num_workers: int | None = None,
    local_ranks: int | None = None,
    cpus: int | None = None,
) -> str | None:
    """The train log's `Throughput epoch` line from every rank's epoch sums, rank by rank:
    (optimizer steps, data s, compute s, sync s). None when no rank made a timed step."""
    splits = [
        RankSplit(rank, *(1000 * x / steps for x in (data, compute, sync)))
        for rank, (steps, data, compute, sync) in enumerate(rows)
        if steps > 0
    ]
    bound = bound_of(splits)
    if bound is None:
        return None
    rate = 1000 * samples_per_step / bound.split.step_ms
    return THROUGHPUT.format(
        epoch=epoch,
        samples_per_s=f"{rate:.0f}" if rate >= 100 else f"{rate:.3g}",
        step_ms=f"{bound.split.step_ms:.1f}",
        split=split_words(bound, len(rows)),
        verdict=verdict_words(bound, num_workers, local_ranks, cpus),
    )
