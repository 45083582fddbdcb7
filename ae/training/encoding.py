"""Encoding shards with a trained checkpoint: rebuild its model, run every sample through
`encode`, and write one output shard per input shard (same keys, the latent as `.npy`).

The model is rebuilt from the checkpoint's own record of its flags (`ae_config`) and loaded from
its `state_dict`, which holds the EMA weights when the run kept an average (Lightning's EMA
callback stores the live weights apart, as `current_model_state`).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import lightning as L
import numpy as np
import torch
from loguru import logger

from ae.config import Config, DataConfig
from ae.data.decoding.decode import InputSpec, SampleDecoder
from ae.data.input_probe import probe_decoder
from ae.data.shards.errors import DataError
from ae.data.shards.writer import ShardWriter, compression_of, npy_bytes
from ae.errors import UserError
from ae.forensics.faults import fault_point
from ae.forensics.progress import progress
from ae.log_lines import ENCODE_PROGRESS, ENCODED_NOT, ENCODED_SHARD
from ae.training.model_build import build_model
from ae.training.position import checkpoint_read


class EncodeError(UserError):
    """A checkpoint or shard set that cannot be encoded: one message naming it."""


def load_checkpoint(path: Path, trust: bool = False) -> dict[str, Any]:
    """The checkpoint of an ae run, read by the safe reader (`ae.training.position.
    checkpoint_read`; `trust`: the old way, `--trust_checkpoint`)."""
    return checkpoint_read.read_ae_checkpoint(path, trust=trust)


def input_config(ckpt: dict[str, Any]) -> DataConfig:
    """The data settings the inputs are decoded with: the training run's (its field, image size,
    scale), with the channels its model was trained on where that run took them from its first
    image (`--channels=0`): the first image of the shards to encode may be grayscale where the
    run's was colour, or the other way round."""
    data = Config.from_flat(ckpt["ae_config"]).data
    trained_on = checkpoint_read.spec_from_record(ckpt.get("hyper_parameters", {}).get("spec"))
    if data.channels == 0 and trained_on is not None and trained_on.kind == "image":
        data = dataclasses.replace(data, channels=trained_on.shape[0])
    return data


def probe_inputs(ckpt: dict[str, Any], urls: list[str], name: str) -> SampleDecoder:
    """The decoder of the shards to encode, with the training run's data settings; shards
    that these do not fit (arrays for a model trained on images: "--channels applies to
    images", a flag the user never gave ae-encode) are named against what the model saw."""
    try:
        return probe_decoder("input", urls, input_config(ckpt))
    except DataError as e:
        trained_on = checkpoint_read.spec_from_record(ckpt.get("hyper_parameters", {}).get("spec"))
        saw = (
            f" ({trained_on.kind}s of shape {'x'.join(map(str, trained_on.shape))})"
            if trained_on is not None
            else ""
        )
        raise EncodeError(
            f"SPEC: these shards do not decode as the data {name} was trained on{saw}, by the "
            f"settings its run recorded: {e.brief()}"
        ) from None


def model_from_checkpoint(
    ckpt: dict[str, Any], spec: InputSpec, name: str
) -> tuple[L.LightningModule, tuple[int, ...]]:
    """The checkpoint's model in eval mode, and one sample's latent shape. `spec`: that of the
    shards to encode, which must be what the model was trained on."""
    trained_on = checkpoint_read.spec_from_record(ckpt.get("hyper_parameters", {}).get("spec"))
    if trained_on is not None and trained_on != spec:
        raise EncodeError(
            f"SPEC: samples have shape {spec.shape}, but {name} was trained on {trained_on.shape}"
        )
    cfg = Config.from_flat(ckpt["ae_config"])  # keys this version lacks are ignored
    model_cfg = dataclasses.replace(cfg.model, compile=False)
    # The discriminator of a GAN-trained checkpoint is built (random, cheap) so that its weights
    # load strictly; LPIPS is never needed to encode.
    module, latent = build_model(spec, model_cfg, cfg.optim, world_size=1, objective=cfg.objective)
    try:
        module.load_state_dict(ckpt["state_dict"])
    except RuntimeError as e:
        raise EncodeError(f"{name}: its weights do not fit its model: {e}") from e
    if latent is None:
        raise EncodeError(f"{name}: its model ({cfg.model.model}) has no encode(x) and decode(z)")
    return module.eval(), latent


def uses_ema(ckpt: dict[str, Any]) -> bool:
    return "current_model_state" in ckpt


class OutputShards:
    """The output shards being written: one per input shard, opened at its first batch and
    closed (renamed into place, indexed) at its last; that of an input shard that could not be
    read to its end is dropped (`damaged`), so that no output holds part of its input: a run of
    the same command, once the input is mended, encodes it whole. Every `PROGRESS_S` seconds,
    at a shard's end, a progress line of this rank: `report` (rank 0's goes to the console)."""

    PROGRESS_S = 30.0

    def __init__(
        self,
        urls: list[str],
        out_paths: list[Path],
        field: str,
        dtype: str,
        planned: tuple[int, int] = (0, 0),
        report: Callable[[str], object] = logger.info,
    ) -> None:
        self.urls, self.out_paths = urls, out_paths
        self.field, self.dtype = field, np.dtype(dtype)
        self._open: dict[int, ShardWriter] = {}
        self.samples = 0
        self.shards = 0
        self.damaged: list[str] = []  # input URLs whose output was dropped
        self.kept: set[str] = set()  # the --keep_fields found in some sample
        self.planned_shards, self.planned_samples = planned
        self._report = report
        self._start = self._last_report = time.monotonic()
        self._read = 0  # samples through the model, those of dropped shards too: the rate

    def add(self, batch: dict[str, Any], latents: np.ndarray) -> None:
        shard = batch["shard"]
        writer = self._open.get(shard)
        if writer is None:
            path = self.out_paths[shard]
            # Compressed as the input's name says (`.tar.gz`, `.tar.xz`): a plain tar under such
            # a name fails `tar xzf` (and `tar xf`, which picks the decompressor by name)
            writer = self._open[shard] = ShardWriter(path, compression_of(path.name))
        for key, latent, kept in zip(batch["keys"], latents, batch["kept"], strict=True):
            writer.add({"__key__": key.encode(), **kept, self.field: npy_bytes(latent)})
            self.kept.update(kept)
        self._read += len(batch["keys"])
        if not batch["last"]:
            return
        if batch.get("damaged"):
            self._open.pop(shard).discard()
            self.damaged.append(self.urls[shard])
            logger.error(ENCODED_NOT.format(url=self.urls[shard], out=writer.path))
        else:
            n = self._open.pop(shard).close()
            self.samples += n
            self.shards += 1
            logger.info(ENCODED_SHARD.format(url=self.urls[shard], out=writer.path, samples=n))
        self._progress()

    def _progress(self) -> None:
        now = time.monotonic()
        if now - self._last_report < self.PROGRESS_S or not self.planned_samples:
            return
        self._last_report = now
        rate = self._read / max(now - self._start, 1e-9)
        left = max(0, self.planned_samples - self._read)
        eta = _clock(left / rate) if rate else "?"
        done = self.shards + len(self.damaged)
        self._report(
            ENCODE_PROGRESS.format(
                shards=done, rank_shards=self.planned_shards, samples=self._read,
                rank_samples=self.planned_samples, rate=f"{rate:.0f}", eta=eta,
            )
        )  # fmt: skip

    def discard_open(self) -> None:
        """After a failure: the unfinished shards leave no file behind."""
        for writer in self._open.values():
            writer.discard()
        self._open.clear()


def _clock(seconds: float) -> str:
    s = int(seconds)
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}"


def encode_all(
    module: L.LightningModule,
    batches: Iterable[dict[str, Any]],
    outputs: OutputShards,
    device: torch.device,
) -> float:
    """Run every batch through `module.encode` and hand the latents to `outputs`; returns the
    seconds it took."""
    t0 = time.perf_counter()
    module.to(device)
    try:
        with torch.no_grad():
            for i, batch in enumerate(batches):  # fetching the next batch: "data loading"
                progress.enter("encoding", step=i)
                fault_point("train", i)
                x = batch["inputs"]
                if len(x):
                    z = module.encode(x.to(device, non_blocking=True)).float().cpu().numpy()
                else:  # an empty last batch closes its shard
                    z = np.empty((0,), np.float32)
                outputs.add(batch, z.astype(outputs.dtype, copy=False))
                progress.enter("data loading", step=i + 1)
    except BaseException:
        outputs.discard_open()
        raise
    return time.perf_counter() - t0
