"""The order in which `stream.shuffle_samples` yields n items, computed on their indices.

`shuffle_samples` fills a buffer of `bufsize` items, then for every further item swaps it with
a random slot (`int(rng.random() * bufsize)`) and yields the slot's old item, and at the end
shuffles the buffer (`rng.shuffle`) and yields it. The order depends only on n and the rng, so it
can be computed without the items, vectorised:

- the draws: `random.random()` is two 32-bit Mersenne Twister outputs `a, b` ->
  `((a >> 5) * 2**26 + (b >> 6)) / 2**53`, and so is numpy's `Generator(MT19937).random()`:
  given the same state it makes bit for bit the same doubles, all in one call;
- step t (item `bufsize + t`) yields the item last put into its slot `j_t`: the item of the
  latest earlier step that drew `j_t`, or item `j_t` itself (the buffer's first fill): one stable
  sort of the draws by slot gives it for every step;
- the rng then continues from numpy's state, and its own `shuffle` orders the last buffer.
"""

from __future__ import annotations

import random

import numpy as np

_MT_WORDS = 624


def _uniforms(rng: random.Random, n: int) -> np.ndarray:
    """The next `n` values of `rng.random()`, as float64; `rng` is advanced past them."""
    version, state, gauss = rng.getstate()
    bits = np.random.MT19937()
    bits.state = {
        "bit_generator": "MT19937",
        "state": {"key": np.asarray(state[:_MT_WORDS], np.uint32), "pos": state[_MT_WORDS]},
    }
    uniforms = np.random.Generator(bits).random(n)  # numpy's MT19937 doubles: Python's formula
    after = bits.state["state"]
    rng.setstate((version, (*after["key"].tolist(), int(after["pos"])), gauss))
    return uniforms


def shuffled_order(n: int, bufsize: int, rng: random.Random) -> np.ndarray:
    """Indices 0..n-1 in the order `shuffle_samples(range(n), bufsize, rng)` yields them,
    leaving `rng` in the state that call leaves it in."""
    if bufsize <= 1:
        return np.arange(n, dtype=np.int64)
    steps = max(0, n - bufsize)
    # int() truncates (draws are >= 0); small ints sort by radix (stable) in numpy
    small = np.uint16 if bufsize <= 1 << 16 else np.int64
    slots = (_uniforms(rng, steps) * bufsize).astype(small)
    out = np.empty(n, dtype=np.int64)
    order = np.argsort(slots, kind="stable")  # steps grouped by slot, in time order
    slots = slots.astype(np.int64)
    sorted_slots = slots[order]
    same = np.empty(steps, dtype=bool)
    same[:1] = False
    same[1:] = sorted_slots[1:] == sorted_slots[:-1]
    previous = np.empty(steps, dtype=np.int64)
    previous[1:] = order[:-1]
    out[order] = np.where(same, bufsize + previous, sorted_slots)
    buffer = np.arange(min(n, bufsize), dtype=np.int64)
    if steps:
        last = np.ones(steps, dtype=bool)  # the last step that drew each slot
        last[:-1] = sorted_slots[1:] != sorted_slots[:-1]
        buffer[sorted_slots[last]] = bufsize + order[last]
    tail = buffer.tolist()
    rng.shuffle(tail)
    out[steps:] = tail
    return out
