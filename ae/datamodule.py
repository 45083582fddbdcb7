"""LightningDataModule over WebDataset shards with an even split across ranks and workers.

`setup()` is where the ranks agree on the data: the node's local rank 0 counts the samples of
every shard (`ae.shard_counts`, cached in `<output_dir>/cache/`), the others read its counts after
a barrier, and all ranks check they hold the same counts (one all-reduce) before building the
same plan. A data problem that makes training pointless raises `DataError` with a
message naming the split's flag, on every rank alike.
"""

from __future__ import annotations

import hashlib
import json
import warnings
from pathlib import Path

import lightning as L
import torch
import torch.distributed as dist
from loguru import logger
from torch.utils.data import DataLoader

from ae.config import Config
from ae.data_errors import DataError
from ae.data_resume import ResumableLoader
from ae.dataset import ShardStream
from ae.decode import InputSpec, decode_sample, spec_of
from ae.log_lines import SHARD_PLAN, main_log
from ae.preemption import PreemptibleLoader
from ae.progress import in_phase
from ae.shard_counts import shared_counts
from ae.tar_samples import iter_samples

# Lightning warns that an IterableDataset with __len__ may be inaccurate with several workers
# unless each is configured independently; ours are (the shard plan gives each worker its slot).
warnings.filterwarnings("ignore", message=r".*`IterableDataset` has `__len__` defined")


def probe_input_spec(split: str, urls: list[str]) -> InputSpec:
    """Shape of the model input: that of the first sample that decodes, trying shards in order
    (damaged ones are reported by the planner and the readers, not here)."""
    problem = "no samples"
    for url in urls:
        try:
            for sample in iter_samples(url):
                try:
                    return spec_of(decode_sample(sample))
                except Exception as e:  # a bad sample: try the next one
                    problem = f"{url}: sample {sample['__key__']}: {e}"
        except Exception as e:  # an unreadable shard: try the next one
            problem = f"{url}: {type(e).__name__}: {e}"
    raise DataError(
        f"{split}_shards: no readable sample in any of {len(urls)} shards (last problem: {problem})"
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


class ShardDataModule(L.LightningDataModule):
    def __init__(self, cfg: Config, train_urls: list[str], val_urls: list[str]) -> None:
        super().__init__()
        self.cfg = cfg
        self.train_urls = train_urls
        self.val_urls = val_urls
        self.spec = probe_input_spec("train", train_urls)
        val_spec = probe_input_spec("val", val_urls)
        if val_spec != self.spec:
            raise DataError(
                f"val_shards: samples have shape {val_spec.shape}, train_shards {self.spec.shape}"
            )
        self.train_set: ShardStream | None = None
        self.val_set: ShardStream | None = None
        self._collective_inputs: list[torch.Tensor] = []

    def _counts(self, split: str, urls: list[str]) -> list[int]:
        """Counted once per node, then checked to be the same on every rank: different counts
        (nodes seeing different files) would give different plans and a hang."""
        trainer = self.trainer
        counts = shared_counts(
            split,
            urls,
            Path(self.cfg.output_dir) / "cache",
            local_zero=trainer is None or trainer.local_rank == 0,
            barrier=trainer.strategy.barrier if trainer else lambda: None,
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

    def _stream(self, split: str, urls: list[str], shuffle: bool) -> ShardStream:
        cfg, trainer = self.cfg, self.trainer
        stream = ShardStream(
            split=split,
            urls=urls,
            counts=self._counts(split, urls),
            spec=self.spec,
            batch_size=cfg.batch_size,
            rank=trainer.global_rank if trainer else 0,
            world_size=trainer.world_size if trainer else 1,
            num_workers=cfg.num_workers,
            mode=cfg.shard_split,
            shuffle=shuffle,
            shuffle_buffer=cfg.shuffle_buffer,
            tar_reader=cfg.tar_reader,
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
                split=split,
                shards=len(urls),
                samples=plan.total_samples,
                batches=plan.batches_per_rank,
                batch_size=cfg.batch_size,
                ranks=plan.world_size,
                workers=plan.num_workers,
                mode=cfg.shard_split,
                dropped=plan.dropped,
                repeated=plan.repeated,
                rank_samples=plan.samples_per_rank,
                worker_batches="/".join(
                    str(plan.worker_batches(w)) for w in range(plan.num_workers)
                ),
            )
        )
        return stream

    def setup(self, stage: str) -> None:
        with in_phase("shard planning"):
            if stage == "fit" and self.train_set is None:
                self.train_set = self._stream("train", self.train_urls, shuffle=True)
            if stage in ("fit", "validate") and self.val_set is None:
                self.val_set = self._stream("val", self.val_urls, shuffle=False)

    def teardown(self, stage: str) -> None:
        """The run-end error summary of this rank, one line per split (workers have exited)."""
        for dataset in (self.train_set, self.val_set):
            if dataset is not None:
                dataset.errors.log_summary(dataset.split)

    def set_epoch(self, epoch: int) -> None:
        if self.train_set is not None:
            self.train_set.epoch = epoch

    def _loader(
        self, dataset: ShardStream, cls: type[PreemptibleLoader] = PreemptibleLoader
    ) -> DataLoader:
        workers = self.cfg.num_workers
        return cls(
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
        # On resume, Lightning then restores the loader's position (ae.data_resume).
        return self._loader(self.train_set, ResumableLoader)

    def val_dataloader(self) -> DataLoader:
        assert self.val_set is not None
        return self._loader(self.val_set)


class EpochSync(L.Callback):
    """Keeps the data order in step with the trainer's epoch (shuffle and plan per epoch).

    Epoch 0's iterator is created before this hook runs; `train_dataloader()` covers it. A resumed
    epoch gets no epoch-start hook: the loader's restored state sets its epoch."""

    def on_train_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        dm = trainer.datamodule
        if isinstance(dm, ShardDataModule):
            dm.set_epoch(trainer.current_epoch)
            logger.debug(f"Data epoch set to {trainer.current_epoch}")
