"""LightningDataModule over WebDataset shards with an even split across ranks and workers.

`setup()` is where the ranks agree on the data: every rank counts its share of the shards
(`ae.data.planning.counts`, kept in the per-user count cache), the shares are exchanged in one
all-gather, and all ranks check they hold the same counts (one all-reduce) before building the same
plan. With `--shard_split=resampled` the train split is not counted at all
(`ae.data.stream.resampled`). Without `--val_shards` the validation split is held out of the train
shards (`ae.data.planning.holdout`),
from the same counts on every rank. A data problem that makes training pointless raises
`DataError` with a message naming the split's flag, on every rank alike.

Every checkpoint holds where the train stream is (`state_dict`: plain data); a resumed run hands
it to the train loader before Lightning first asks for it (`ae.data.stream.resume`).
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import json
import warnings
from collections import Counter
from pathlib import Path
from typing import Any

import lightning as L
import numpy as np
import torch
import torch.distributed as dist
from loguru import logger
from torch.utils.data import DataLoader

from ae.config import PREFETCH_FACTOR, DataConfig
from ae.data.decoding.decode import InputSpec, SampleDecoder, SampleError
from ae.data.planning.counts import count_cache_dir, shared_counts
from ae.data.planning.holdout import Holdout, hold_out
from ae.data.planning.plan import ShardSlice
from ae.data.shards.errors import DataError
from ae.data.shards.keys import first_sample_merged
from ae.data.shards.tar_samples import iter_samples
from ae.data.stream.loader import PreemptibleLoader
from ae.data.stream.resume import ResumableLoader, Resume
from ae.data.stream.shard_stream import ShardStream
from ae.forensics.progress import in_phase
from ae.log_lines import INPUT_FIELD, SHARD_PLAN, VALIDATION_HELD_OUT, VALIDATION_OFF, main_log


def silence_known_warnings() -> None:
    """Lightning warns that an IterableDataset with __len__ may be inaccurate with several
    workers unless each is configured independently; ours are (the shard plan gives each worker
    its slot). Call after logging is configured: a filter added later takes precedence."""
    warnings.filterwarnings("ignore", message=r".*`IterableDataset` has `__len__` defined")


# Samples tried before a split with no usable sample is given up on: the first samples of a
# dataset tell whether its fields can be decoded, without reading all of it.
PROBE_SAMPLES = 1000
# Images at native size (no --image_size) must all have one size: the headers of the first
# samples of the first shard and of the first sample of the next shards tell, cheaply.
SIZE_PROBE_FIRST_SHARD, SIZE_PROBE_SHARDS = 8, 16


def check_one_image_size(split: str, urls: list[str], decoder: SampleDecoder) -> None:
    """DataError naming --image_size and the sizes seen when the first samples of the split
    (see SIZE_PROBE_*) have images of several sizes: the run would train only on those of the
    first sample's size, the others replaced by repeats of them."""
    if decoder.kind != "image" or decoder.image_size:
        return
    sizes: Counter[str] = Counter()
    for i, url in enumerate(urls[:SIZE_PROBE_SHARDS]):
        wanted = SIZE_PROBE_FIRST_SHARD if i == 0 else 1
        with contextlib.suppress(Exception):  # a damaged shard: the readers report it
            for sample in itertools.islice(iter_samples(url), wanted):
                if (size := decoder.header_size(sample)) is not None:
                    sizes[size] += 1
    if len(sizes) > 1:
        shown = ", ".join(f"{size} ({n})" for size, n in sizes.most_common(5))
        shorter = min(min(int(v) for v in size.split("x")) for size in sizes)
        raise DataError(
            f"{split}_shards: images of several sizes in the first {sum(sizes.values())} "
            f"samples read: {shown}{', ...' if len(sizes) > 5 else ''}; at native size only those "
            f"of the first one's could be trained on. Pass --image_size=N (the shorter side "
            f"resized to N, then cropped to NxN), e.g. --image_size={min(64, shorter)}"
        )


def probe_decoder(
    split: str, urls: list[str], cfg: DataConfig, decoder: SampleDecoder | None = None
) -> SampleDecoder:
    """The decoder of the run, from the first sample that decodes (trying shards in order;
    damaged ones are reported by the planner and the readers, not here). With `decoder` (the
    train split's), check that this split's samples decode the same way and shape instead."""
    problem, tried = "no samples", 0
    for url in urls:
        try:
            for sample in iter_samples(url):
                tried += 1
                try:
                    if decoder is None:
                        return SampleDecoder.probe(sample, cfg)
                    decoder.decode(sample)
                    return decoder
                except SampleError as e:  # a bad sample: try the next one
                    problem = f"{url}: sample {sample['__key__']}: {e}"
                if tried == PROBE_SAMPLES:
                    break
        except DataError:  # flags that cannot work on this data
            raise
        except Exception as e:  # an unreadable shard: try the next one
            problem = f"{url}: {type(e).__name__}: {e}"
        if tried == PROBE_SAMPLES:
            break
    raise DataError(
        f"{split}_shards: no readable sample in any of {len(urls)} shards (first {tried} "
        f"samples tried; last problem: {problem})"
    )


def log_input(decoder: SampleDecoder, cfg: DataConfig) -> None:
    source = "--input_key" if cfg.input_key else "the first decodable field of the first sample"
    main_log.info(
        INPUT_FIELD.format(
            field=decoder.field_names,
            source=source,
            shape="x".join(map(str, decoder.shape)),
            detail=decoder.describe(),
        )
    )


def same_on_all_ranks(values: list[int], device: torch.device, keep: list[torch.Tensor]) -> bool:
    """One all-reduce: the MAX of (d, -d) over ranks is (max d, -min d), equal iff every rank's
    digest d of `values` is the same. The reduced tensor is appended to `keep`, which the caller
    holds until the run ends: were the tensor's last reference dropped while gloo's worker thread
    still held the op, that thread would take the GIL to free it, and a dataloader worker forked
    at that moment can hang in fork (seen once here: gloo, CPython 3.11)."""
    digest = int.from_bytes(hashlib.sha256(json.dumps(values).encode()).digest()[:7])
    both = torch.tensor([digest, -digest], dtype=torch.int64, device=device)
    dist.all_reduce(both, op=dist.ReduceOp.MAX)
    keep.append(both)
    return int(both[0]) == -int(both[1])


def _merged_hint(urls: list[str]) -> str:
    """For a "too few samples" message: whether files were merged by WebDataset's key rule."""
    why = first_sample_merged(urls)
    return f". Few samples? {why}" if why else ""


class ShardDataModule(L.LightningDataModule):
    def __init__(
        self,
        cfg: DataConfig,
        train_urls: list[str],
        val_urls: list[str] | None,
        *,
        seed: int,
        debug: bool = False,
    ) -> None:
        """`val_urls` None: validation held out of the train shards, or none with
        `--val_shards=none`. `debug`: per-shard lines. Shard counts are kept in
        `cfg.count_cache`."""
        super().__init__()
        self.cfg = cfg
        self.cache_dir: Path | None = count_cache_dir(cfg.count_cache)
        self.seed, self.debug = seed, debug
        self.train_urls = train_urls
        self.val_urls = val_urls
        self.validates = cfg.validates
        self.decoder = probe_decoder("train", train_urls, cfg)
        check_one_image_size("train", train_urls, self.decoder)
        if val_urls is not None:
            probe_decoder("val", val_urls, cfg, self.decoder)
        log_input(self.decoder, cfg)
        if not self.validates:
            main_log.info(VALIDATION_OFF)
        self.train_set: ShardStream | None = None
        self.val_set: ShardStream | None = None
        self._train_loader: ResumableLoader | None = None  # one for the run: persistent workers
        self.trained_batches = 0  # of the current epoch, as Lightning counts them (`EpochSync`)
        self.resumed: Resume | None = None  # how the train stream resumed, if it did
        self._reload_until_resumed = False  # Lightning re-reads the loader's length meanwhile
        self._collective_inputs: list[torch.Tensor] = []

    @property
    def spec(self) -> InputSpec:
        return self.decoder.spec

    def first_samples(self, n: int = 2) -> torch.Tensor:
        """The first `n` (or fewer) decodable validation samples (train samples when validation
        is held out of them or off), as a batch, read again from the start of the first shards:
        the real batch the model check before training runs through the model
        (`ae.training.model.latent_shape`)."""
        found: list[np.ndarray] = []
        for url in self.val_urls or self.train_urls:
            try:
                for sample in iter_samples(url):
                    try:
                        found.append(self.decoder.decode(sample))
                    except SampleError:
                        continue
                    if len(found) == n:
                        return torch.from_numpy(np.stack(found))
            except DataError:
                raise
            except Exception:  # an unreadable shard: the planner and readers report it
                continue
        return torch.from_numpy(np.stack(found))  # the probe found at least one

    def _counts(self, split: str, urls: list[str]) -> list[int]:
        """Counted by all ranks (a share each, one all-gather), then checked to be the same on
        every rank: different counts would give different plans and a hang."""
        trainer = self.trainer
        distributed = trainer is not None and trainer.world_size > 1

        def gather(mine: dict) -> list[dict]:
            if not distributed:
                return [mine]
            parts: list[dict] = [{}] * trainer.world_size
            dist.all_gather_object(parts, mine)
            return parts

        counts = shared_counts(
            split,
            urls,
            self.cache_dir,
            rank=trainer.global_rank if trainer else 0,
            world_size=trainer.world_size if trainer else 1,
            gather=gather,
            write_sidecars=self.cfg.write_index == "auto",
        )
        if counts.total == 0:
            raise DataError(f"{split}_shards: no readable sample in {len(urls)} shards")
        if (
            trainer is not None
            and trainer.world_size > 1
            and not same_on_all_ranks(
                counts.counts, trainer.strategy.root_device, self._collective_inputs
            )
        ):
            raise DataError(
                f"{split}_shards: ranks counted different samples per shard (do all nodes see"
                " the same files?); see the `Shard counts` line in each rank's log"
            )
        return counts.counts

    def _stream(
        self,
        split: str,
        urls: list[str],
        shuffle: bool,
        counts: list[int] | None = None,
        parts: tuple[ShardSlice, ...] = (),
    ) -> ShardStream:
        """The split's stream over `urls` (counted here unless `counts` are given), or over
        their stretches `parts` (validation held out of the train shards)."""
        cfg, trainer = self.cfg, self.trainer
        # Resampled: the train split is never counted; validation stays counted (drop mode).
        resampled = cfg.shard_split == "resampled" and split == "train"
        mode = cfg.shard_split if resampled or cfg.shard_split != "resampled" else "drop"
        stream = ShardStream(
            split=split,
            urls=urls,
            counts=[] if resampled else counts or self._counts(split, urls),
            decoder=self.decoder,
            batch_size=cfg.batch_size,
            rank=trainer.global_rank if trainer else 0,
            world_size=trainer.world_size if trainer else 1,
            num_workers=cfg.num_workers,
            mode=mode,
            parts=parts,
            epoch_samples=cfg.epoch_samples if resampled else 0,
            shuffle=shuffle,
            augment=shuffle,  # training: random crops and flips; validation: center crops
            shuffle_buffer=cfg.shuffle_buffer,
            tar_reader=cfg.tar_reader,
            seed=self.seed,
            debug=self.debug,
        )
        plan = stream.plan()
        if plan.batches_per_rank == 0:
            raise DataError(
                f"{split}_shards: {plan.total_samples} samples cannot give each of "
                f"{plan.world_size} ranks one batch of {cfg.batch_size}; lower --batch_size,"
                + (" raise --epoch_samples" if resampled else " or use --shard_split=pad")
                + _merged_hint(urls)
            )
        main_log.info(
            SHARD_PLAN.format(
                split=split,
                shards=len(urls),
                samples=plan.total_samples,
                batches=plan.batches_per_rank,
                batch_size=cfg.batch_size,
                ranks=plan.world_size,
                workers=plan.num_workers,
                mode=mode,
                dropped=plan.dropped,
                repeated=plan.repeated,
                rank_samples=plan.samples_per_rank,
                worker_batches="/".join(
                    str(plan.worker_batches(w)) for w in range(plan.num_workers)
                ),
            )
        )
        return stream

    def _held_out(self) -> tuple[ShardStream, ShardStream]:
        """Train and val streams over one split of the train shards (`ae.data.planning.holdout`)."""
        cfg, trainer, urls = self.cfg, self.trainer, self.train_urls
        world = trainer.world_size if trainer else 1
        batch = world * cfg.batch_size  # one batch per rank, the least either split needs
        resampled = cfg.shard_split == "resampled"
        # Resampled training draws whole shards, so whole shards are held out (each counts 1).
        counts = [1] * len(urls) if resampled else self._counts("train", urls)
        total = sum(counts)
        need = 2 if resampled else 2 * batch
        if total < need:
            unit = f"{total} shard(s)" if resampled else f"{total} samples"
            raise DataError(
                f"train_shards: {unit} cannot hold out validation (one batch of "
                f"{cfg.batch_size} per rank on {world} ranks) and still train on the rest; pass "
                f"--val_shards=SPEC or --val_shards=none, or lower --batch_size"
                + ("" if resampled else _merged_hint(urls))
            )
        split = hold_out(counts, cfg.val_fraction, 1 if resampled else batch)
        main_log.info(
            VALIDATION_HELD_OUT.format(
                val=Holdout.size(split.val), total=total, train=Holdout.size(split.train),
                unit="shards" if resampled else "samples", by="shard" if resampled else split.by,
                fraction=f"{cfg.val_fraction:g}",
            )
        )  # fmt: skip
        if resampled:
            val_urls = [urls[p.shard] for p in split.val]
            self.train_urls = [urls[p.shard] for p in split.train]
            return (
                self._stream("train", self.train_urls, shuffle=True),
                self._stream("val", val_urls, shuffle=False),
            )
        return (
            self._stream("train", urls, shuffle=True, counts=counts, parts=split.train),
            self._stream("val", urls, shuffle=False, counts=counts, parts=split.val),
        )

    def setup(self, stage: str) -> None:
        with in_phase("shard planning"):
            held_out = self.validates and self.val_urls is None
            if held_out and self.train_set is None:
                self.train_set, self.val_set = self._held_out()
            if stage == "fit" and self.train_set is None:
                self.train_set = self._stream("train", self.train_urls, shuffle=True)
            if stage in ("fit", "validate") and self.val_set is None and self.val_urls:
                self.val_set = self._stream("val", self.val_urls, shuffle=False)

    def train_worker_rates(self) -> list[dict[str, Any]]:
        """How fast this rank's train workers read (heartbeat `data_workers`); none before
        setup."""
        return self.train_set.worker_rates() if self.train_set is not None else []

    def teardown(self, stage: str) -> None:
        """The run-end error summary of this rank, one line per split (workers have exited)."""
        for dataset in (self.train_set, self.val_set):
            if dataset is not None:
                dataset.errors.log_summary(dataset.split)

    def set_epoch(self, epoch: int) -> None:
        if self.train_set is not None:
            self.train_set.epoch = epoch
        if self._train_loader is not None:
            self._train_loader.forget_resume_before(epoch)

    def _loader(
        self, dataset: ShardStream, cls: type[PreemptibleLoader] = PreemptibleLoader
    ) -> DataLoader:
        workers = self.cfg.num_workers
        persistent = workers > 0 and cls is ResumableLoader  # train; validation runs seldom
        return cls(
            dataset,
            batch_size=None,  # workers yield whole batches
            num_workers=workers,
            pin_memory=torch.cuda.is_available(),
            # Train workers live across epochs (they read each epoch's position from the
            # stream's shared `position`) and keep their mapped shards: 2.5-4x the samples/s of
            # workers started every epoch, for short epochs of large batches (bench/README.md).
            # Validation workers start for each validation: no second set of idle processes.
            persistent_workers=persistent,
            prefetch_factor=PREFETCH_FACTOR if workers else None,
        )

    def _train(self) -> ResumableLoader:
        assert self.train_set is not None
        if self._train_loader is None:
            self._train_loader = self._loader(self.train_set, ResumableLoader)
        return self._train_loader

    def train_dataloader(self) -> DataLoader:
        loader = self._train()
        epoch = self.trainer.current_epoch if self.trainer else 0
        # Lightning asks for the loader before it restores its loops (its epoch is then 0): until
        # Lightning is past it, the epoch a checkpoint resumes is the loader's.
        resumed = loader.resuming()
        self.set_epoch(max(epoch, resumed) if resumed is not None else epoch)
        if self._reload_until_resumed and loader.resuming() is None:
            # this epoch's length is the run's again: Lightning keeps it from now on
            self.trainer.reload_dataloaders_every_n_epochs = 0
            self._reload_until_resumed = False
        return loader

    def epoch_lengths(self) -> tuple[int, int, int]:
        """(batches of the current epoch trained, its length, a whole epoch's length), as
        Lightning counts them: a resumed epoch counts the batches before the resume."""
        loader = self._train()
        current = len(loader)
        stream = self.train_set
        assert stream is not None
        saved = stream.resumed
        stream.resumed = False
        whole = stream.plan().batches_per_rank
        stream.resumed = saved
        return self.trained_batches, current, whole

    # --- where the train stream is, in every checkpoint (plain data: `ae.data.stream.resume`)
    # ------
    def state_dict(self) -> dict[str, Any]:
        if self._train_loader is None:
            return {}
        return {"train": self._train_loader.position(self.trained_batches)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Called on resume after `setup`, before Lightning first asks for the train loader."""
        if "train" not in state_dict:
            return
        self.resumed = self._train().resume(state_dict["train"])
        self.trained_batches = self.resumed.offset + self.resumed.skip
        if self.resumed.note and self.trainer is not None:
            # The resumed epoch has another length than the next ones: Lightning takes the
            # length of each epoch's loader again (the same loader, its workers kept).
            self.trainer.reload_dataloaders_every_n_epochs = 1
            self._reload_until_resumed = True

    def val_dataloader(self) -> DataLoader | list:
        if self.val_set is None:  # --val_shards=none (the trainer validates nothing either)
            return []
        return self._loader(self.val_set)


class EpochSync(L.Callback):
    """Keeps the data order in step with the trainer's epoch (shuffle and plan per epoch).

    Epoch 0's iterator is created before this hook runs; `train_dataloader()` covers it. A resumed
    epoch gets no epoch-start hook: the loader's restored state sets its epoch."""

    def on_train_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        dm = trainer.datamodule
        if isinstance(dm, ShardDataModule):
            dm.set_epoch(trainer.current_epoch)
            dm.trained_batches = 0
            logger.debug(f"Data epoch set to {trainer.current_epoch}")

    def on_load_checkpoint(
        self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        """A checkpoint from before the data module kept the train position has it where
        Lightning kept the loader's (its fit loop's state): resumed from there alike, with the
        same settings (called after the data module's own restore, before the loader is built)."""
        dm = trainer.datamodule
        if not isinstance(dm, ShardDataModule) or type(dm).__qualname__ in checkpoint:
            return
        fit = checkpoint.get("loops", {}).get("fit_loop", {})
        loaders = fit.get("state_dict", {}).get("combined_loader") or [{}]
        progress = fit.get("epoch_loop.batch_progress", {}).get("current", {})
        if "epoch" in loaders[0] and "processed" in progress:
            dm.load_state_dict(
                {"train": {"epoch": loaders[0]["epoch"], "batches": progress["processed"]}}
            )

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, idx: int
    ) -> None:
        """Counts the epoch's batches before any checkpoint of this batch is saved (the step
        boundary comes later in the callback list): the loader itself is a batch ahead."""
        dm = trainer.datamodule
        if isinstance(dm, ShardDataModule):
            dm.trained_batches = idx + 1
