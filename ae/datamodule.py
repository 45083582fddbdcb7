"""LightningDataModule over WebDataset shards with an even split across ranks and workers."""

from __future__ import annotations

import warnings

import lightning as L
import torch
from loguru import logger
from torch.utils.data import DataLoader

from ae.config import Config
from ae.dataset import ShardStream
from ae.decode import InputSpec, decode_sample, spec_of
from ae.log_lines import SHARD_PLAN, main_log
from ae.tar_samples import count_samples, iter_samples

# Lightning warns that an IterableDataset with __len__ may be inaccurate with several workers
# unless each is configured independently; ours are (the shard plan gives each worker its slot).
warnings.filterwarnings("ignore", message=r".*`IterableDataset` has `__len__` defined")


class DataError(RuntimeError):
    """The data cannot be trained on (no samples, too few for one batch per rank)."""


def probe_input_spec(urls: list[str]) -> InputSpec:
    """Shape of the model input, from the first sample of the first shard."""
    for sample in iter_samples(urls[0]):
        return spec_of(decode_sample(sample))
    raise DataError(f"first shard has no samples: {urls[0]}")


class ShardDataModule(L.LightningDataModule):
    def __init__(self, cfg: Config, train_urls: list[str], val_urls: list[str]) -> None:
        super().__init__()
        self.cfg = cfg
        self.train_urls = train_urls
        self.val_urls = val_urls
        self.spec = probe_input_spec(train_urls)
        self.train_set: ShardStream | None = None
        self.val_set: ShardStream | None = None

    def _stream(self, split: str, urls: list[str], shuffle: bool) -> ShardStream:
        cfg, trainer = self.cfg, self.trainer
        counts = [count_samples(u) for u in urls]
        stream = ShardStream(
            split=split,
            urls=urls,
            counts=counts,
            spec=self.spec,
            batch_size=cfg.batch_size,
            rank=trainer.global_rank if trainer else 0,
            world_size=trainer.world_size if trainer else 1,
            num_workers=cfg.num_workers,
            mode=cfg.shard_split,
            shuffle=shuffle,
            shuffle_buffer=cfg.shuffle_buffer,
            seed=cfg.seed,
            debug=cfg.debug,
        )
        plan = stream.plan()
        if plan.batches_per_rank == 0:
            raise DataError(
                f"{split}_shards: {plan.total_samples} samples cannot give each of "
                f"{plan.world_size} ranks one batch of {cfg.batch_size}; lower --batch_size"
                " or use --shard_split=pad"
            )
        main_log.info(
            SHARD_PLAN.format(
                split=split, shards=len(urls), samples=plan.total_samples,
                batches=plan.batches_per_rank, batch_size=cfg.batch_size, ranks=plan.world_size,
                workers=plan.num_workers, mode=cfg.shard_split, dropped=plan.dropped,
                repeated=plan.repeated,
            )
        )  # fmt: skip
        return stream

    def setup(self, stage: str) -> None:
        if stage == "fit" and self.train_set is None:
            self.train_set = self._stream("train", self.train_urls, shuffle=True)
        if stage in ("fit", "validate") and self.val_set is None:
            self.val_set = self._stream("val", self.val_urls, shuffle=False)

    def set_epoch(self, epoch: int) -> None:
        if self.train_set is not None:
            self.train_set.epoch = epoch

    def _loader(self, dataset: ShardStream) -> DataLoader:
        workers = self.cfg.num_workers
        return DataLoader(
            dataset,
            batch_size=None,  # workers yield whole batches
            num_workers=workers,
            pin_memory=torch.cuda.is_available(),
            persistent_workers=False,  # each epoch re-pickles the dataset with its new epoch
            prefetch_factor=4 if workers else None,
        )

    def train_dataloader(self) -> DataLoader:
        assert self.train_set is not None
        self.set_epoch(self.trainer.current_epoch if self.trainer else 0)
        return self._loader(self.train_set)

    def val_dataloader(self) -> DataLoader:
        assert self.val_set is not None
        return self._loader(self.val_set)


class EpochSync(L.Callback):
    """Keeps the data order in step with the trainer's epoch (shuffle and plan per epoch).

    Epoch 0's iterator is created before this hook runs; `train_dataloader()` covers it."""

    def on_train_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        dm = trainer.datamodule
        if isinstance(dm, ShardDataModule):
            dm.set_epoch(trainer.current_epoch)
            logger.debug(f"Data epoch set to {trainer.current_epoch}")
