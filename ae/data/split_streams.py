"""A split's stream on one rank, planned and logged: over whole shards (`stream`), or train and
validation over one split of the train shards (`held_out`, without `--val_shards`:
`ae.data.planning.holdout`). A plan that cannot give every rank a batch raises `DataError`
naming the flags that would fix it, on every rank alike (they all plan from the same counts).

A resumed run holds out what the run it resumes held out: the hold-out's least count is the first
run's one batch per rank, recorded in every checkpoint (`HeldOut.record`, which
`ShardDataModule.state_dict` saves), not this run's. Where that is fewer samples than this run's
batch per rank (a larger batch, more ranks), validation fills its batch by repeating some of its
own samples (the plan's `pad` mode, as `--shard_split=pad` fills a val split's last batches): a
train sample never moves into it."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from ae.config import DataConfig
from ae.data.decoding.decode import SampleDecoder
from ae.data.planning.holdout import Holdout, hold_out
from ae.data.planning.plan import ShardSlice, SplitMode
from ae.data.shards.errors import DataError
from ae.data.shards.keys import first_sample_merged
from ae.data.stream.shard_stream import ShardStream
from ae.log_lines import SHARD_PLAN, VALIDATION_HELD_OUT, main_log


def _merged_hint(urls: list[str]) -> str:
    """For a "too few samples" message: whether files were merged by WebDataset's key rule."""
    why = first_sample_merged(urls)
    return f". Few samples? {why}" if why else ""


@dataclass(frozen=True)
class HeldOut:
    """Train and validation over one split of the train shards."""

    train_urls: list[str]  # the shards training reads
    train: ShardStream
    val: ShardStream
    # What a checkpoint keeps for a resumed run to hold out the same: the least count held out
    # (the first run's one batch per rank) and its unit.
    record: dict[str, Any]


@dataclass
class StreamBuilder:
    """Builds the streams of one rank. `count(split, urls)`: the shards' sample counts, the same
    on every rank (`ae.data.rank_agreement.agreed_counts`)."""

    cfg: DataConfig
    decoder: SampleDecoder
    count: Callable[[str, list[str]], list[int]]
    rank: int
    world_size: int
    seed: int
    debug: bool

    def stream(
        self,
        split: str,
        urls: list[str],
        shuffle: bool,
        counts: list[int] | None = None,
        parts: tuple[ShardSlice, ...] = (),
        pad: bool = False,
    ) -> ShardStream:
        """The split's stream over `urls` (counted here unless `counts` are given), or over
        their stretches `parts` (validation held out of the train shards); `pad`: in pad mode
        whatever `--shard_split` says (held-out validation smaller than a batch per rank)."""
        cfg = self.cfg
        # Resampled: the train split is never counted; validation stays counted (drop mode).
        resampled = cfg.shard_split == "resampled" and split == "train"
        mode: SplitMode = cfg.shard_split if resampled or cfg.shard_split != "resampled" else "drop"
        if pad:
            mode = "pad"
        stream = ShardStream(
            split=split,
            urls=urls,
            counts=[] if resampled else counts or self.count(split, urls),
            # the JPEGs leave the workers as bytes for the GPU (`ae.data.decoding.gpu_jpeg`)
            decoder=replace(self.decoder, gpu_jpeg=cfg.image_decode == "gpu"),
            batch_size=cfg.batch_size,
            rank=self.rank,
            world_size=self.world_size,
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
            ranks = f"{plan.world_size} rank{'s' * (plan.world_size != 1)}"
            raise DataError(
                f"{split}_shards: {plan.total_samples} samples cannot fill one batch of "
                f"{cfg.batch_size} per rank on {ranks}; lower --batch_size,"
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

    def held_out(self, urls: list[str], resumed: dict[str, Any] | None = None) -> HeldOut:
        """Train and validation over one split of the train shards `urls`
        (`ae.data.planning.holdout`). `resumed`: the record of the run this one resumes
        (`HeldOut.record`), whose least count it holds out again."""
        cfg, world = self.cfg, self.world_size
        batch = world * cfg.batch_size  # one batch per rank, the least either split needs
        resampled = cfg.shard_split == "resampled"
        # Resampled training draws whole shards, so whole shards are held out (each counts 1).
        unit = "shards" if resampled else "samples"
        counts = [1] * len(urls) if resampled else self.count("train", urls)
        total = sum(counts)
        # A record in another unit (--shard_split changed to or from resampled) does not apply.
        kept = resumed.get("least") if resumed is not None and resumed.get("unit") == unit else None
        again = kept is not None
        least = int(kept) if kept is not None else 1 if resampled else batch
        need = least + (1 if resampled else batch)
        if total < need:
            held = f"at least {least} {unit}, as the run resumed did" if again else (
                f"one batch of {cfg.batch_size} per rank on {world} rank{'s' * (world != 1)}"
            )  # fmt: skip
            raise DataError(
                f"train_shards: {total} {unit} cannot hold out validation ({held}) and still "
                f"train on the rest; pass --val_shards=SPEC or --val_shards=none, or lower "
                f"--batch_size" + ("" if resampled else _merged_hint(urls))
            )
        split = hold_out(counts, cfg.val_fraction, least)
        val = Holdout.size(split.val)
        # Fewer than a batch per rank only on a resume with a larger batch or more ranks.
        pad = not resampled and val < batch
        repeats = f", {batch - val} of them repeated to fill one batch per rank" if pad else ""
        at_least = f"{least} samples" if again else "one batch per rank"
        main_log.info(
            VALIDATION_HELD_OUT.format(
                val=val, total=total, train=Holdout.size(split.train), unit=unit,
                by="shard" if resampled else split.by,
                resumed="as in the run resumed: " if again else "",
                fraction=f"{cfg.val_fraction:g}", least="one shard" if resampled else at_least,
                repeats=repeats,
            )
        )  # fmt: skip
        record = {"least": least, "unit": unit}
        if resampled:
            val_urls = [urls[p.shard] for p in split.val]
            train_urls = [urls[p.shard] for p in split.train]
            return HeldOut(
                train_urls,
                self.stream("train", train_urls, shuffle=True),
                self.stream("val", val_urls, shuffle=False),
                record,
            )
        return HeldOut(
            urls,
            self.stream("train", urls, shuffle=True, counts=counts, parts=split.train),
            self.stream("val", urls, shuffle=False, counts=counts, parts=split.val, pad=pad),
            record,
        )
