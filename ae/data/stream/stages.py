"""The stages of a slot's general path, as plain generator functions, WebDataset style:

    read_slices -> shuffle_samples -> (skip, on mid-epoch resume) -> decode_samples
        -> fill_quota -> batch_samples

`ShardStream` (`ae.data.stream.shard_stream`) chains them for each slot of the plan.

The shuffle buffer holds raw (encoded) samples: smaller than decoded arrays, and a resumed epoch
can drop the samples it already trained on without decoding them (`ae.data.stream.resume`).

Bad data is handled by the stages, not the tar parser: `read_slices` logs a shard that cannot be
opened or ends early, `decode_samples` a sample that fails to decode or has the wrong shape (both
at ERROR, naming shard and sample key) and drops it; `fill_quota` then tops the slot up to its
planned count by repeating good samples of the slot (a seeded reservoir of at most
`REPLACEMENT_POOL`), so every rank still yields exactly `plan.batches_per_rank` full batches and
no rank is left waiting in an all-reduce.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import random
import time
from collections.abc import Callable, Iterable, Iterator
from typing import TypeVar

import numpy as np
import torch
from loguru import logger

from ae.data.decoding.decode import Augment, InputSpec, SampleDecoder
from ae.data.decoding.gpu_jpeg import EncodedBatch
from ae.data.decoding.jpeg import EncodedJpeg
from ae.data.planning.plan import ShardSlice
from ae.data.shards.errors import SlotErrors
from ae.data.shards.index import sample_offset
from ae.data.shards.tar_samples import ByteCount, RawSample, TarReader, iter_samples
from ae.data.stream.worker_stats import SlotMeter

# Replacements for bad samples cycle through a reservoir sample of this many good samples of the
# slot: enough variety for a few bad samples, bounded memory for a whole bad shard.
REPLACEMENT_POOL = 64

T = TypeVar("T")


def read_shard(
    url: str, start: int, stop: int, reader: TarReader = "fast", count: ByteCount | None = None
) -> Iterator[RawSample]:
    """Samples [start, stop) of one shard. A local shard with an index is entered by seeking to
    sample `start`; others are read from the top and the first `start` samples skipped.
    `count`: adds the bytes read."""
    offset = sample_offset(url, start)
    skip = start if offset is None else 0
    samples = iter_samples(url, offset or 0, reader, count)
    try:
        yield from itertools.islice(samples, skip, skip + stop - start)
    finally:
        # Stopping before a pipe's end makes its command exit on SIGPIPE, which gopen reports
        # as an error on close; the samples asked for were all read, so it is no error here.
        with contextlib.suppress(Exception):
            samples.close()


def read_slices(
    urls: list[str],
    slices: list[ShardSlice],
    errors: SlotErrors,
    debug: bool = False,
    reader: TarReader = "fast",
    meter: SlotMeter | None = None,
) -> Iterator[RawSample]:
    """Each slice's samples in order. A shard that fails, or ends before the slice does, is
    reported (ERROR line naming it and the last good sample) and the next slice read. `meter`
    is told which shard is read and counts its bytes."""
    for s in slices:
        url, want, got, last_key = urls[s.shard], s.stop - s.start, 0, None
        t0 = time.perf_counter()
        if meter is not None:
            meter.shard(s.shard)
        samples = read_shard(url, s.start, s.stop, reader, meter.count if meter else None)
        reason = None
        try:
            for sample in samples:
                got, last_key = got + 1, sample["__key__"]
                yield sample
        except Exception as e:  # unreadable/truncated shard, failed pipe or download
            reason = f"{type(e).__name__}: {e}"
        finally:
            samples.close()
        if reason is None and got < want:
            reason = "shard ended early: truncated, or its index or cached count is out of date"
        if reason is not None:
            errors.bad_shard(url, reason, last_key, want - got, want)
        elif debug:
            logger.debug(
                f"Shard {url}: samples [{s.start}, {s.stop}) in {time.perf_counter() - t0:.2f}s"
            )


def decode_samples(
    samples: Iterable[RawSample],
    decoder: SampleDecoder,
    errors: SlotErrors,
    augment: Augment | None = None,
) -> Iterator[np.ndarray | EncodedJpeg]:
    """Decode (and check the shape); a bad sample is reported (ERROR line) and dropped.
    `augment`: training's random crops and flips; None: center crops. With the decoder's
    `gpu_jpeg`, most JPEGs come out still encoded, for the GPU."""
    for sample in samples:
        try:
            array = decoder.decode(sample, augment)
        except Exception as e:  # decoders raise anything on bad bytes: it is the sample's fault
            errors.bad_sample(sample.get("__url__", "?"), sample["__key__"], str(e))
            continue
        yield array


def _reservoir_weight(rng: random.Random, k: int) -> float:
    return math.exp(math.log(1.0 - rng.random()) / k)  # 1 - random() is in (0, 1]


def _reservoir_skip(rng: random.Random, w: float) -> int:
    return int(math.log(1.0 - rng.random()) / math.log(max(1.0 - w, 1e-300)))


def fill_quota(
    items: Iterable[np.ndarray],
    quota: int,
    rng: random.Random,
    fallback: Callable[[], list[np.ndarray]],
    errors: SlotErrors,
) -> Iterator[np.ndarray]:
    """Pass `items` through, then repeat good samples until `quota` were yielded. Replacements
    cycle through a reservoir sample of the slot's good samples; a slot that got none takes its
    pool from `fallback()` (good samples of other shards)."""
    pool: list[np.ndarray] = []
    n = 0
    k = REPLACEMENT_POOL
    # Reservoir sampling with geometric skips (Li's Algorithm L): a few random draws per pool
    # replacement instead of one per sample, which mattered at 100k+ samples/s.
    w = next_pick = 0.0
    for item in items:
        if n < k:
            pool.append(item)
            if n == k - 1:
                w = _reservoir_weight(rng, k)
                next_pick = n + 1 + _reservoir_skip(rng, w)
        elif n == next_pick:
            pool[rng.randrange(k)] = item
            w *= _reservoir_weight(rng, k)
            next_pick = n + 1 + _reservoir_skip(rng, w)
        n += 1
        yield item
    missing = quota - n
    if missing <= 0:
        return
    if not pool:
        pool = fallback()
    errors.replaced(missing)
    for i in range(missing):
        yield pool[i % len(pool)]


def shuffle_samples(items: Iterable[T], bufsize: int, rng: random.Random) -> Iterator[T]:
    """Reservoir-style shuffle buffer: yields a random element of the last `bufsize` seen."""
    if bufsize <= 1:
        yield from items
        return
    buf: list[T] = []
    for item in items:
        if len(buf) < bufsize:
            buf.append(item)
            continue
        i = int(rng.random() * bufsize)  # randrange() costs 3x as much, per sample
        buf[i], item = item, buf[i]
        yield item
    rng.shuffle(buf)
    yield from buf


def batch_samples(items: Iterable[np.ndarray], batch_size: int, spec: InputSpec) -> Iterator:
    """Stack samples into preallocated float32 batches; a trailing partial batch is not yielded
    (the plan hands every slot a multiple of `batch_size`, so there is none)."""
    out = np.empty((batch_size, *spec.shape), dtype=np.float32)
    i = 0
    for item in items:
        out[i] = item
        i += 1
        if i == batch_size:
            yield torch.from_numpy(out)
            out = np.empty_like(out)
            i = 0


def batch_encoded(
    items: Iterable[np.ndarray | EncodedJpeg], batch_size: int, spec: InputSpec
) -> Iterator[EncodedBatch]:
    """`batch_samples` for `--image_decode=gpu`: batches of JPEG bytes (and of the arrays the
    worker decoded), which the rank decodes on its GPU (`ae.data.decoding.gpu_jpeg`)."""
    batch: list[np.ndarray | EncodedJpeg] = []
    for item in items:
        batch.append(item)
        if len(batch) == batch_size:
            yield EncodedBatch.of(batch, spec.shape)
            batch = []
