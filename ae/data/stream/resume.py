"""Resuming the train stream mid-epoch, with the same settings or others.

The data module records where the train stream is in every checkpoint (`position`: plain data)
and hands it back on resume (`ResumableLoader.resume`), before the first batch is drawn:

- A checkpoint taken after an epoch's last batch resumes at the start of the next epoch.
- With the same data settings (world size, `--batch_size`, `--num_workers`, `--shuffle_buffer`,
  `--seed`, `--shard_split`), epoch e resumes after batch k with exactly the batches an
  uninterrupted run would have trained on next: each worker re-reads its share of the first k
  batches and drops those samples undecoded (`ShardStream.skip_batches`).
- With other settings, the samples the epoch already trained on are worked out from the old
  plan (`remainder`): each old slot (rank, worker) had handed out its first n samples, in the
  order of its shuffle buffer, which depends only on the seed, the epoch and the slot. What is
  left of the epoch's sequence (a few intervals: each slot's unread stretch and the samples still
  in its buffer) becomes the `base` of a new plan, split evenly over the new ranks and workers by
  the usual rules (`drop`: fewer than world size x batch size samples of it are dropped; `pad`:
  repeated). Every sample the epoch had not trained on is trained on once, none twice.

Lightning counts the resumed epoch's batches on from k, so the loader's length for that epoch is
k plus the new plan's batches; later epochs are whole again. What Lightning's loops are told of
this is `ae.training.position`'s, which owns the run's position.

Every position also says how many samples of its epoch were trained (`trained_samples`, all
ranks together), which the `Resumed` line reports.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from loguru import logger

from ae.data.planning.plan import plan_epoch
from ae.data.stream.batch_buffers import received, release_table
from ae.data.stream.loader import PreemptibleLoader
from ae.data.stream.read_ahead import read_ahead
from ae.data.stream.resume_arithmetic import remainder
from ae.data.stream.shard_stream import ShardStream
from ae.forensics.step_times import step_times

# The settings whose change re-splits the rest of an interrupted epoch.
SPLIT_KEYS = ("world_size", "num_workers", "batch_size", "mode", "shuffle_buffer", "seed")


def same_cuda_device() -> Callable[[], None]:
    """For a thread of the rank's: use the rank's CUDA device (pinning from a thread on device 0
    would make every rank a CUDA context there)."""
    device = torch.cuda.current_device() if torch.cuda.is_initialized() else None
    return lambda: None if device is None else torch.cuda.set_device(device)


def split_settings(stream: ShardStream) -> dict[str, Any]:
    """How `stream` splits an epoch: what a resumed epoch must know of the run it continues."""
    return {
        "world_size": stream.world_size,
        "num_workers": max(1, stream.num_workers),  # 0 (in-process) reads as one slot
        "batch_size": stream.batch_size,
        "mode": stream.mode,
        "shuffle_buffer": stream.shuffle_buffer if stream.shuffle else 0,
        "seed": stream.seed,
        "epoch_samples": stream.epoch_samples,
    }


def counts_digest(counts: list[int]) -> str:
    return hashlib.sha256(json.dumps(list(counts)).encode()).hexdigest()[:16]


@dataclass
class Resume:
    """A resumed epoch: `offset` batches (Lightning's count) came before the stream's plan, of
    which `skip` batches per rank were trained on."""

    epoch: int
    offset: int
    skip: int
    base: tuple[tuple[int, int], ...] | None
    note: str  # what was done, for the `Settings changed` line ("" when nothing changed)
    order_seed: int  # the seed of the shard order that `base`'s positions refer to
    before: int = 0  # samples of the epoch (all ranks) trained in its first `offset` batches
    saved_epoch: int = -1  # the epoch the checkpoint was taken in (one less: it had ended)
    dropped: int = 0  # samples of the saved epoch's rest that filled no batch (left out)

    def trained_samples(self, world_size: int, batch_size: int) -> int:
        """Samples of the epoch (all ranks) trained when it resumes."""
        return self.before + self.skip * world_size * batch_size


def plan_resume(stream: ShardStream, state: dict[str, Any]) -> Resume:
    """Where `stream` resumes, from the `position` a checkpoint recorded."""
    epoch, done = int(state["epoch"]), int(state["batches"])
    old = state.get("split")  # absent in checkpoints older than this field: same settings
    now = split_settings(stream)
    was = old or now
    offset = int(state.get("offset", 0))
    # older checkpoints did not say: their batches were of the settings recorded
    before = int(state.get("before", offset * was["world_size"] * was["batch_size"]))
    trained = int(
        state.get(
            "trained_samples", before + (done - offset) * was["world_size"] * was["batch_size"]
        )
    )
    base = tuple(tuple(b) for b in state["base"]) if state.get("base") is not None else None
    # The shard order of the epoch's sequence is the checkpoint's seed's, also under a new seed.
    order_seed = int(state.get("base_seed", old["seed"] if old else stream.seed))
    stream.epoch = epoch
    length = state.get("epoch_batches")
    if length is None:  # an older checkpoint: its epochs were as long as this run's
        length = len(stream)
    if done >= length:  # saved after the epoch's last batch: the next epoch is next
        return Resume(epoch + 1, 0, 0, None, "", stream.seed, saved_epoch=epoch)
    # Other shards (other sample counts) first: the checkpoint's batches of the epoch say nothing
    # of them, under the same split settings too (skipping its k batches of other shards left
    # "batch 6 of 5", an epoch that ended before its first batch).
    if state.get("counts") not in (None, counts_digest(stream.plan_counts)):
        return Resume(
            epoch, done, 0, None,
            f"the shards changed: epoch {epoch} restarts over them after batch {done}",
            stream.seed, trained, epoch,
        )  # fmt: skip
    if old is None or all(old.get(k) == now[k] for k in (*SPLIT_KEYS, "epoch_samples")):
        return Resume(epoch, offset, done - offset, base, "", order_seed, before, epoch)
    if old["mode"] == "resampled":  # no sequence: a count of samples left, drawn anew
        had = old["epoch_samples"] if base is None else sum(b - a for a, b in base)
        left = had - (done - offset) * old["world_size"] * old["batch_size"]
        rest: tuple[tuple[int, int], ...] = ((0, max(0, left)),)
    else:
        old_plan = plan_epoch(
            stream.plan_counts,
            world_size=old["world_size"],
            num_workers=old["num_workers"],
            batch_size=old["batch_size"],
            mode=old["mode"],
            seed=order_seed,
            epoch=epoch,
            shuffle=stream.shuffle,
            base=base,
        )
        rest = remainder(
            old_plan, done - offset, shuffle_buffer=old["shuffle_buffer"], seed=old["seed"],
            epoch=epoch,
        )  # fmt: skip
    samples = sum(b - a for a, b in rest)
    ranks, workers = stream.world_size, max(1, stream.num_workers)
    return Resume(
        epoch, done, 0, rest,
        f"re-split the rest of epoch {epoch} ({samples} samples not yet trained on) over "
        f"{ranks} rank{'s' * (ranks != 1)} x {workers} worker{'s' * (workers != 1)} x batch "
        f"{stream.batch_size}",
        order_seed, trained, epoch,
    )  # fmt: skip


class ResumableLoader(PreemptibleLoader):
    """A DataLoader over a `ShardStream` that resumes an epoch where a checkpoint left it, and
    times how long the rank waits for each batch (`ae.forensics.step_times`)."""

    dataset: ShardStream

    def __init__(self, dataset: ShardStream, **kwargs: Any) -> None:
        super().__init__(dataset, **kwargs)
        self._resume: Resume | None = None  # until the resumed epoch's last batch
        # Read on a thread of its own when the rank reads its batches itself for a GPU (pinned
        # batches): the step only queues kernels, so reading on the training thread idles the
        # GPU (`ae.data.stream.read_ahead`; docs/BENCHMARKS.md has the figures).
        self.reads_ahead = self.num_workers == 0 and self.pin_memory
        # Before the workers fork: they reuse their batch buffers.
        if self.num_workers > 0 and dataset.reuses_buffers:
            dataset.released = release_table(self.num_workers)

    def resuming(self) -> int | None:
        """The epoch being resumed, until its last batch; None otherwise."""
        return self._resume.epoch if self._resume is not None else None

    def forget_resume_before(self, epoch: int) -> None:
        """The resumed epoch is over once a later one starts (Lightning may end an epoch at its
        length without draining the loader)."""
        if self._resume is not None and epoch > self._resume.epoch:
            self._resume = None

    def _active(self) -> Resume | None:
        resume = self._resume
        return resume if resume is not None and resume.epoch == self.dataset.epoch else None

    def __len__(self) -> int:
        resume = self._active()
        stream = self.dataset
        stream.resumed = resume is not None and resume.base is not None
        return stream.plan().batches_per_rank + (resume.offset if resume else 0)

    def __iter__(self) -> Iterator[torch.Tensor]:
        stream, resume = self.dataset, self._active()
        stream.resumed = resume is not None and resume.base is not None
        stream.skip_batches = resume.skip if resume else 0
        batches = super().__iter__()
        if self.reads_ahead:
            batches = read_ahead(batches, on_start=same_cuda_device())
        elif stream.released is not None:
            batches = received(stream.released, batches)
        while True:
            started = time.perf_counter()
            try:
                batch = next(batches)
            except StopIteration:
                if resume is not None and resume is self._resume:  # the resumed epoch is over
                    self._resume = None
                return
            step_times.fetched(started, time.perf_counter())  # the rank's data wait
            yield batch

    def position(self, batches: int) -> dict[str, Any]:
        """Where the stream is after `batches` batches (Lightning's count) of its epoch: plain
        data for the checkpoint."""
        stream, resume = self.dataset, self._active()
        return {
            "epoch": stream.epoch,
            "batches": batches,
            "epoch_batches": len(self),
            "offset": resume.offset if resume else 0,
            "base": [list(b) for b in resume.base] if resume and resume.base is not None else None,
            "base_seed": resume.order_seed if resume else stream.seed,
            "before": resume.before if resume else 0,
            "trained_samples": (resume.before if resume else 0)
            + (batches - (resume.offset if resume else 0)) * stream.world_size * stream.batch_size,
            "split": split_settings(stream),
            "counts": counts_digest(stream.plan_counts),
        }

    # Lightning's interface of a resumable loader: where this loader is lives in the data module's
    # state (`position`), restored before the loader is built, so Lightning keeps nothing of it;
    # answering the interface tells Lightning that its resumes are exact.
    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Nothing to restore here: `resume` took the data module's position already."""

    def _enter(self, resume: Resume) -> Resume:
        self._resume = resume
        self.dataset.epoch, self.dataset.base = resume.epoch, resume.base
        self.dataset.base_seed = resume.order_seed
        return resume

    def resume(self, state: dict[str, Any]) -> Resume:
        """Continue from a checkpoint's `position` (before the first batch is drawn)."""
        resume = self._enter(plan_resume(self.dataset, state))
        if resume.base is not None and len(self) == resume.offset:
            # the rest fills no batch of the new plan (all of it dropped): the epoch is over
            left = sum(b - a for a, b in resume.base)
            note = f"{resume.note}; none of it fills a batch: epoch {resume.epoch + 1} starts"
            resume = self._enter(
                Resume(resume.epoch + 1, 0, 0, None, note, self.dataset.seed,
                       saved_epoch=resume.epoch, dropped=left)
            )  # fmt: skip
        total = len(self)
        done = resume.offset + resume.skip
        logger.info(
            f"Resuming the train data at epoch {resume.epoch}, batch {done} of {total}"
            + (f" (skipping the {resume.skip} batches already trained on)" if resume.skip else "")
            + (f"; {resume.note}" if resume.note else "")
        )
        return resume
