"""LightningDataModule over WebDataset shards with an even split across ranks and workers.

Building it reads nothing: the shards are first read in `setup()` (or by `probe()`, for a caller
that needs the input spec before training, as `ae.rank.train` does to build the model). There the
run's decoder is probed from the first samples (`ae.data.input_probe`) and the ranks agree on the
data: every rank counts its share of the shards (`ae.data.planning.counts`, kept in the per-user
count cache), the shares are exchanged in one all-gather, and all ranks check they hold the same
counts (one all-reduce, `ae.data.rank_agreement`) before building the same plan
(`ae.data.split_streams`). With `--shard_split=resampled` the train split is not counted at all
(`ae.data.stream.resampled`). Without `--val_shards` the validation split is held out of the
train shards (`ae.data.planning.holdout`), from the same counts on every rank. A data problem that
makes training pointless raises `DataError` with a message naming the split's flag, on every rank
alike.

Every checkpoint holds where the train stream is (`state_dict`: plain data); a resumed run hands
it to the train loader before Lightning first asks for it (`ae.data.stream.resume`). It also
holds how validation was held out of the train shards, which a resumed run hands to `resume_plan`
before `setup` plans the split, so that it holds out what the run it resumes held out.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning as L
import torch
from loguru import logger
from torch.utils.data import DataLoader

from ae.config import PREFETCH_FACTOR, DataConfig
from ae.data.decoding.decode import InputSpec, SampleDecoder
from ae.data.decoding.gpu_jpeg import EncodedBatch, decode_on, gpu_decode_problem
from ae.data.input_probe import (
    check_one_image_size,
    colour_after_gray,
    first_decodable,
    image_headers,
    log_input,
    probe_decoder,
)
from ae.data.planning.counts import count_cache_dir
from ae.data.rank_agreement import agreed_counts
from ae.data.shards.errors import DataError
from ae.data.split_streams import StreamBuilder
from ae.data.stream.loader import PreemptibleLoader
from ae.data.stream.resume import ResumableLoader, Resume
from ae.data.stream.shard_stream import ShardStream
from ae.forensics.progress import in_phase
from ae.log_lines import VALIDATION_OFF, main_log

HOLDOUT = "holdout"  # the state_dict's record of the held-out validation split


class ShardDataModule(L.LightningDataModule):
    def __init__(
        self,
        cfg: DataConfig,
        train_urls: list[str],
        val_urls: list[str] | None,
        *,
        seed: int,
        debug: bool = False,
        rank: int = 0,
    ) -> None:
        """`val_urls` None: validation held out of the train shards, or none with
        `--val_shards=none`. `debug`: per-shard lines. `rank`: this process's global rank
        (warnings about the data are rank 0's; the others log them as INFO). Shard counts are
        kept in `cfg.count_cache`. Reads no shard (see `probe` and `setup`)."""
        super().__init__()
        self.cfg = cfg
        self.cache_dir: Path | None = count_cache_dir(cfg.count_cache)
        self.seed, self.debug, self.rank = seed, debug, rank
        self.train_urls = train_urls
        self.val_urls = val_urls
        self.validates = cfg.validates
        self._decoder: SampleDecoder | None = None  # `probe()`
        self.train_set: ShardStream | None = None
        self.val_set: ShardStream | None = None
        self._train_loader: ResumableLoader | None = None  # one for the run: persistent workers
        self.trained_batches = 0  # of the current epoch, as Lightning counts them (`EpochSync`)
        self.resumed: Resume | None = None  # how the train stream resumed, if it did
        # How validation is held out of the train shards (`HeldOut.record`), kept from run to run
        # (`resume_plan`); None until planned or resumed.
        self.holdout: dict[str, Any] | None = None
        self._reload_until_resumed = False  # Lightning re-reads the loader's length meanwhile
        # The inputs of this rank's data collectives, kept until the run ends
        # (`ae.data.rank_agreement.same_on_all_ranks` says why).
        self.collective_inputs: list[torch.Tensor] = []

    def probe(self) -> SampleDecoder:
        """The run's decoder, probed from the first samples of the train shards (once: later
        calls return it), the val shards checked to decode alike and the input logged. `setup`
        calls it; call it first to know the input spec before training."""
        if self._decoder is None:
            cfg = self.cfg
            decoder = probe_decoder("train", self.train_urls, cfg)
            headers = image_headers(self.train_urls, decoder, cfg)
            check_one_image_size("train", headers, decoder)
            if self.val_urls is not None:
                probe_decoder("val", self.val_urls, cfg, decoder)
            log_input(decoder, cfg)
            if (warning := colour_after_gray(headers, decoder, cfg)) is not None:
                # once in the train log: every rank probes the same shards and finds the same
                (main_log.warning if self.rank == 0 else logger.info)(warning)
            if not self.validates:
                main_log.info(VALIDATION_OFF)
            self._decoder = decoder
        return self._decoder

    @property
    def decoder(self) -> SampleDecoder:
        if self._decoder is None:
            raise RuntimeError("ShardDataModule: the decoder is known after probe() or setup()")
        return self._decoder

    @property
    def spec(self) -> InputSpec:
        return self.decoder.spec

    def first_samples(self, n: int = 2) -> torch.Tensor:
        """The first `n` (or fewer) decodable validation samples (train samples when validation
        is held out of them or off), as a batch, read again from the start of the first shards:
        the real batch the model check before training runs through the model
        (`ae.training.model_build.latent_shape`). Probes first if need be."""
        return first_decodable(self.val_urls or self.train_urls, self.probe(), n)

    def _builder(self) -> StreamBuilder:
        trainer = self.trainer

        def count(split: str, urls: list[str]) -> list[int]:
            return agreed_counts(
                split, urls, trainer, cache_dir=self.cache_dir,
                write_sidecars=self.cfg.write_index == "auto", keep=self.collective_inputs,
            )  # fmt: skip

        return StreamBuilder(
            self.cfg,
            self.decoder,
            count,
            rank=trainer.global_rank if trainer else 0,
            world_size=trainer.world_size if trainer else 1,
            seed=self.seed,
            debug=self.debug,
        )

    def setup(self, stage: str) -> None:
        self.probe()
        if self.cfg.image_decode == "gpu":
            self._check_gpu_decode()
        with in_phase("shard planning"):
            build = self._builder()
            held_out = self.validates and self.val_urls is None
            if held_out and self.train_set is None:
                split = build.held_out(self.train_urls, resumed=self.holdout)
                self.train_urls, self.holdout = split.train_urls, split.record
                self.train_set, self.val_set = split.train, split.val
            if stage == "fit" and self.train_set is None:
                self.train_set = build.stream("train", self.train_urls, shuffle=True)
            if stage in ("fit", "validate") and self.val_set is None and self.val_urls:
                self.val_set = build.stream("val", self.val_urls, shuffle=False)

    def _check_gpu_decode(self) -> None:
        """DataError naming --image_decode when this rank cannot decode JPEGs on its GPU."""
        device = self.trainer.strategy.root_device if self.trainer is not None else None
        problem = gpu_decode_problem()
        if problem is None and device is not None and device.type != "cuda":
            problem = f"this run trains on {device.type} (--accelerator)"
        if problem is not None:
            raise DataError(
                f"image_decode: gpu decodes JPEGs on each rank's CUDA device, but {problem}; "
                "use --image_decode=cpu"
            )

    def transfer_batch_to_device(
        self, batch: Any, device: torch.device, dataloader_idx: int
    ) -> Any:
        """Lightning's move of each batch to the rank's device; a batch of JPEG bytes
        (`--image_decode=gpu`) is decoded there."""
        if isinstance(batch, EncodedBatch):
            return decode_on(batch, device)
        return super().transfer_batch_to_device(batch, device, dataloader_idx)

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
            # workers started every epoch, for short epochs of large batches (docs/BENCHMARKS.md).
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

    # --- where the train stream is, in every checkpoint (plain data: `ae.data.stream.resume`) --
    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {}
        if self._train_loader is not None:
            state["train"] = self._train_loader.position(self.trained_batches)
        if self.holdout is not None:
            state[HOLDOUT] = dict(self.holdout)
        return state

    def resume_plan(self, state: dict[str, Any]) -> None:
        """Before `setup`: what the split's planning takes from the `state_dict` of the checkpoint
        resumed: how it held validation out (`ae.data.split_streams.HeldOut.record`). A
        checkpoint from before the record holds out as a fresh run does."""
        record = state.get(HOLDOUT)
        if isinstance(record, dict):
            self.holdout = dict(record)

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
