"""The flags, each declared once: type, default, range and help, in the section of the concern
that uses it. `Config` is the whole; each component receives only its section."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Literal

import yaml

from ae.run_paths import RunDir


def show_value(value: Any) -> str:
    """A value as the user writes it: lists as `1,2,4`."""
    return ",".join(map(str, value)) if isinstance(value, tuple) else str(value)


def _opt(
    default: Any,
    help: str,
    *,
    lo: float | None = None,
    hi: float | None = None,
    none_is_a_value: bool = False,
    joins: str | None = None,
) -> Any:
    """`none_is_a_value`: the word `none` is a value of the flag (`--val_shards=none`), not the
    unset default it means elsewhere. `joins`: a string of several items joined by this
    separator, which a YAML file may also give as a list."""
    meta = {"help": help, "lo": lo, "hi": hi, "none_is_a_value": none_is_a_value, "joins": joins}
    return field(default=default, metadata=meta)


@dataclass(frozen=True)
class RunConfig:
    """The run: its folder, its processes, when it stops."""

    config: str | None = _opt(None, "YAML file with any of these keys; flags override it")
    print_config: bool = _opt(False, "print the resolved config as YAML and exit")
    output_dir: str = _opt("runs/ae", "run folder: logs/ and checkpoints/ go below it")
    overwrite: bool = _opt(
        False, "start afresh in an output_dir holding an earlier run's checkpoints (deletes them)"
    )
    devices: str = _opt("auto", "processes per node: a number, or auto (all GPUs, else 2 CPU)")
    num_nodes: int = _opt(1, "number of nodes", lo=1)
    accelerator: Literal["auto", "cpu", "gpu"] = _opt("auto", "auto picks gpu when CUDA is present")
    precision: Literal["32", "bf16-mixed", "16-mixed"] = _opt("32", "numeric precision")
    max_epochs: int = _opt(5, "stop after this many epochs (-1 = no limit)", lo=-1)
    max_steps: int = _opt(-1, "stop after this many optimizer steps (-1 = no limit)", lo=-1)
    val_interval: int = _opt(
        0, "also validate every N optimizer steps (0 = at epoch end only)", lo=0
    )
    seed: int = _opt(42, "random seed (data order, init)", lo=0)
    max_restarts: int = _opt(
        0, "after a failed rank, restart the job from its newest checkpoint up to N times", lo=0
    )
    min_nodes: int = _opt(
        0,
        "with --max_restarts on several nodes: go on with at least K nodes when others are lost "
        "(0 = all nodes: the job waits for every node)",
        lo=0,
    )

    @property
    def dir(self) -> RunDir:
        return RunDir(Path(self.output_dir))


# `--val_shards=none`: no validation at all (and no best.ckpt).
NO_VALIDATION = "none"


@dataclass(frozen=True)
class DataConfig:
    """Shards and the input pipeline."""

    train_shards: str | None = _opt(
        None,
        "shard spec (brace, glob, dir, pipe:CMD, http(s)://; several joined by ::); default: "
        "demo digits",
        joins="::",
    )
    val_shards: str | None = _opt(
        None,
        "validation shard spec, or none (no validation, no best.ckpt); default: --val_fraction "
        "of --train_shards held out (the demo digits' val split with the demo train split)",
        none_is_a_value=True,
        joins="::",
    )
    val_fraction: float = _opt(
        0.01,
        "without --val_shards: the share of --train_shards held out for validation, at least "
        "one batch per rank (by whole shards from 1/val_fraction shards on, else by sample)",
        lo=0.0001,
        hi=0.5,
    )
    batch_size: int = _opt(32, "samples per batch per device", lo=1)
    num_workers: int = _opt(2, "dataloader worker processes per rank", lo=0, hi=64)
    shard_split: Literal["drop", "pad", "resampled"] = _opt(
        "drop",
        "even split across ranks: drop the remainder, pad by repeating samples, or resampled "
        "(no counting: each worker draws whole shards at random with replacement, an epoch is "
        "--epoch_samples; for sets too large or too remote to count)",
    )
    epoch_samples: int = _opt(
        0,
        "samples per training epoch, all ranks together; required by --shard_split=resampled",
        lo=0,
    )
    count_cache: str = _opt(
        "auto",
        "per-user cache of shard sample counts, reused by every run: auto (~/.cache/ae/"
        "shard-counts, or $AE_CACHE_DIR/shard-counts), a folder, or off",
    )
    write_index: Literal["auto", "never"] = _opt(
        "auto", "write the index sidecar of a local shard counted by reading it (writable folders)"
    )
    shuffle_buffer: int = _opt(1000, "samples in each worker's shuffle buffer (0 = off)", lo=0)
    tar_reader: Literal["fast", "tarfile"] = _opt(
        "fast", "tar parsing: fast (header cutting) or tarfile (Python's module, the reference)"
    )
    input_key: str | None = _opt(
        None,
        "sample field to train on, as WebDataset names it (x.npy, image.jpg, jpg; 'jpg;png': "
        "whichever the sample has; x.npz/NAME: one array of an npz); default: the first "
        "decodable field of the first sample (an image field: with any image extension)",
    )
    image_size: int = _opt(
        0,
        "images: resize the shorter side to N, then crop N x N (random crop in training, center "
        "in validation and sampling); 0 = native size, which must then be the same for all",
        lo=0,
    )
    channels: int = _opt(
        0, "images: 1 (grayscale) or 3 (RGB), whatever each image's mode; 0 = as the first", lo=0
    )
    random_flip: bool = _opt(False, "images: flip half of the training images left-right")
    image_decode: Literal["cpu", "gpu"] = _opt(
        "cpu",
        "images: where JPEGs are decoded: cpu (the loader's workers) or gpu (nvJPEG on each "
        "rank's GPU, a batch at a time: the workers only read; needs torchvision; other formats "
        "and grayscale stay on the CPU)",
    )
    max_bad_fraction: float = _opt(
        0.01,
        "stop when more than this share of an epoch's samples (on any rank) is bad and replaced",
        lo=0,
        hi=1,
    )
    npy_scale: float = _opt(
        1.0,
        "arrays (npy/npz/pth): multiply the float32 values by this (e.g. 0.00392156863 = 1/255 "
        "for uint8 pixels); 1 = values as stored",
    )

    @property
    def validates(self) -> bool:
        return self.val_shards != NO_VALIDATION


# Batches each dataloader worker keeps ready (not a flag): they wait in /dev/shm, so the
# preflight (ae.job.preflight) counts them. 4 kept two workers' 1 MB batches flowing where 2
# stalled now and then on a busy machine (docs/BENCHMARKS.md).
PREFETCH_FACTOR = 4


@dataclass(frozen=True)
class ModelConfig:
    """The autoencoder (docs/TRAINING.md has a section per model)."""

    model: str = _opt(
        "auto",
        "auto (mlp for vectors, conv for images), mlp, conv, resnet, or your own class as "
        "package.module:ClassName",
    )
    model_args: dict[str, Any] | None = _opt(  # noqa: RUF009 (the default is None)
        None, "keyword arguments of your own class: a YAML/JSON mapping, e.g. '{width: 64}'"
    )
    latent_dim: int = _opt(16, "mlp, conv: size of the bottleneck vector", lo=1)
    hidden_dim: int = _opt(
        256, "conv: channels of its first stage x8; mlp: widths hidden_dim,hidden_dim/2", lo=8
    )
    hidden_dims: tuple[int, ...] = _opt(
        (), "mlp: widths of the hidden layers, e.g. 1024,512 (overrides hidden_dim)", lo=1
    )
    downsample: int = _opt(
        8, "resnet: stride-2 stages reduce H and W by this factor f (2, 4, 8, 16)", lo=2, hi=16
    )
    latent_channels: int = _opt(4, "resnet: channels of the spatial latent (H/f x W/f)", lo=1)
    base_channels: int = _opt(64, "resnet: channels of the first stage", lo=1)
    channel_mult: tuple[int, ...] = _opt(
        (1, 2, 4, 4), "resnet: channels per resolution (x base_channels), the first log2(f)+1", lo=1
    )
    res_blocks: int = _opt(2, "resnet: residual blocks per resolution", lo=1)
    kl_weight: float = _opt(
        0.0, "> 0: a VAE (mean and log-variance, sampled latent) with this weight on the KL", lo=0
    )
    loss: Literal["mse", "l1", "smooth_l1"] = _opt("mse", "reconstruction loss")
    ema_decay: float = _opt(
        0.0,
        "keep an EMA of the weights (e.g. 0.999) for validation, grids, ae-encode; 0 = off",
        lo=0,
    )
    compile: bool = _opt(False, "run the model through torch.compile")


@dataclass(frozen=True)
class OptimConfig:
    """Learning rate, its schedule and scaling, and the optimizer step."""

    learning_rate: float = _opt(1e-3, "base learning rate, before scaling by world size", lo=0)
    lr_scale: Literal["linear", "sqrt", "none"] = _opt(
        "sqrt", "scale the base LR by world size: linear, sqrt (AdamW-friendly) or none"
    )
    warmup_steps: int = _opt(50, "linear LR warmup over this many optimizer steps", lo=0)
    lr_scheduler: Literal["cosine", "constant"] = _opt(
        "cosine", "LR after warmup: cosine decay to 0 at the last step, or constant"
    )
    encoder_lr_mult: float = _opt(1.0, "encoder LR = effective LR x this", lo=0)
    decoder_lr_mult: float = _opt(1.0, "decoder LR = effective LR x this", lo=0)
    weight_decay: float = _opt(1e-4, "AdamW weight decay", lo=0)
    gradient_accumulation_steps: int = _opt(1, "batches per optimizer step", lo=1)
    gradient_clip_val: float = _opt(1.0, "clip gradient norm to this (0 = off)", lo=0)
    find_unused_parameters: bool = _opt(
        False,
        "several processes: let DDP find parameters that get no gradient in a step (e.g. "
        "CompressAI's entropy bottleneck, trained by its own aux loss); slower per step, so off "
        "unless the model check asks for it",
    )
    on_nonfinite: Literal["stop", "skip", "rollback"] = _opt(
        "stop",
        "a non-finite loss or gradient: stop (every rank, nothing saved after it), skip (that "
        "optimizer step, on every rank) or rollback (to the newest checkpoint, its batches not "
        "trained again)",
    )
    max_skipped_steps: int = _opt(
        10, "skip/rollback: after this many non-finite steps, the next one stops the run", lo=0
    )


@dataclass(frozen=True)
class ObjectiveConfig:
    """The latent-diffusion recipe on top of --loss (images): LPIPS and a PatchGAN discriminator
    (docs/TRAINING.md; docs/autoencoder_kl_f8.yaml sets them as CompVis does); rFID at
    validation."""

    perceptual_weight: float = _opt(
        0.0,
        "weight of LPIPS (VGG16) in the loss; the recipe's 1.0; > 0 needs the two weights "
        "files of --perceptual_weights, and reports val/lpips",
        lo=0,
    )
    perceptual_weights: str = _opt(
        "auto",
        "folder holding vgg16-397923af.pth (torchvision's VGG16) and vgg.pth (the LPIPS v0.1 "
        "heads); auto: torch's cache ($TORCH_HOME/hub/checkpoints), heads also from an installed "
        "lpips package",
    )
    fid_weights: str | None = _opt(
        None,
        "images: also report val/rfid, the FID of the reconstructions to the validation images, "
        "with the FID Inception v3 of this file (pytorch-fid's "
        "pt_inception-2015-12-05-6726825d.pth, or a folder holding it); costs an Inception "
        "pass at 299 px per image and reconstruction at each validation",
    )
    disc_weight: float = _opt(
        0.0,
        "weight of the PatchGAN hinge loss, times the adaptive weight; the recipe's 0.5; "
        "0 = no discriminator",
        lo=0,
    )
    disc_start: int = _opt(
        50001, "optimizer step at which the discriminator and its loss start (the recipe's)", lo=0
    )
    disc_lr: float = _opt(
        0.0,
        "discriminator LR before world-size scaling (Adam betas 0.5,0.9, no weight decay); "
        "0 = --learning_rate",
        lo=0,
    )
    disc_layers: int = _opt(3, "discriminator: stride-2 stages (taming's n_layers)", lo=1, hi=6)
    disc_channels: int = _opt(64, "discriminator: channels of its first conv (taming's ndf)", lo=1)


@dataclass(frozen=True)
class CheckpointConfig:
    """Checkpoints: how often, how many, and where to resume from."""

    checkpointing_period: int = _opt(
        500, "optimizer steps between step checkpoints (0 = none by step count)", lo=0
    )
    checkpoints_total_limit: int = _opt(3, "keep at most this many step checkpoints", lo=1)
    save_best: bool = _opt(True, "also keep best.ckpt, the one with the lowest val loss")
    resume_from_checkpoint: str | None = _opt(
        None, "checkpoint path, or last (<output_dir>/checkpoints/last.ckpt, if any)"
    )
    trust_checkpoint: bool = _opt(
        False,
        "load a checkpoint the safe loader refuses; runs code from the file: only for "
        "files you made",
    )
    # On by default: with 500 steps between saves and slow steps, a kill overnight could lose
    # hours; a timed save costs nothing between saves (the ranks' step vote carries it).
    checkpoint_minutes: float = _opt(
        30.0, "also save at the first step boundary M minutes after the last save (0 = off)", lo=0
    )


@dataclass(frozen=True)
class ObservabilityConfig:
    """Logs, the stall watchdog, straggler detection, and reconstruction samples."""

    debug: bool = _opt(False, "per-batch and per-shard progress lines in the debug_rank logs")
    log_every_n_train_batches: int = _opt(500, "progress line cadence in training", lo=1)
    log_every_n_val_batches: int = _opt(20, "progress line cadence in validation", lo=1)
    stall_timeout: float = _opt(
        300.0, "seconds without progress before a STALL report (0 = no watchdog)", lo=0
    )
    hang_timeout: float = _opt(
        1800.0,
        "a rank stalled this many seconds writes its STALL report and exits (code 124), so the "
        "job restarts or ends (0 = never; needs the watchdog, --stall_timeout > 0)",
        lo=0,
    )
    pg_timeout: float = _opt(
        600.0, "collective timeout (s): ranks waiting on a dead or stuck peer then fail", lo=1
    )
    straggler_factor: float = _opt(
        1.3, "a rank whose own time per step is this x the median is a straggler (0 = off)", lo=0
    )
    straggler_window: float = _opt(
        60.0, "seconds a rank must stay above --straggler_factor to be named a straggler", lo=1
    )
    log_rotate_mb: float = _opt(0.0, "rotate each log file at this size in MB (0 = never)", lo=0)
    log_rotate_keep: int = _opt(3, "rotated files kept per log (name.log.1 .. .N)", lo=1)
    sample_period: int = _opt(-1, "reconstruction sampling every N steps (-1 = off)", lo=-1)
    sample_every_epoch: bool = _opt(
        True, "image data: a reconstruction grid at the end of every epoch too"
    )
    sample_batch_size: int = _opt(16, "per-device batch for sampling", lo=1)
    num_sample_batches: int = _opt(1, "batches reconstructed per sampling", lo=1)
    logger: str = _opt(
        "csv,tensorboard",
        "where metrics go, comma-separated: csv, tensorboard, wandb (pip install -e '.[wandb]'; "
        "WANDB_MODE=offline keeps it local), mlflow (pip install -e '.[mlflow]')",
        joins=",",
    )
    experiment: str = _opt("ae", "wandb: the project; mlflow: the experiment name")
    mlflow_tracking_uri: str | None = _opt(
        None, "mlflow: where runs are stored; default: a file store, <output_dir>/mlruns"
    )


@dataclass(frozen=True)
class Config:
    """Train an autoencoder on WebDataset shards across ranks, with per-rank logs."""

    run: RunConfig = field(default_factory=RunConfig)
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    objective: ObjectiveConfig = field(default_factory=ObjectiveConfig)
    checkpoints: CheckpointConfig = field(default_factory=CheckpointConfig)
    obs: ObservabilityConfig = field(default_factory=ObservabilityConfig)

    @classmethod
    def from_flat(cls, values: dict[str, Any]) -> Config:
        """From flat `{flag: value}` (missing flags take their defaults)."""
        parts = {
            name: section(**{k: values[k] for k in _SECTION_FLAGS[name] if k in values})
            for name, section in SECTIONS.items()
        }
        return cls(**parts)

    def to_dict(self) -> dict[str, Any]:
        """Flat `{flag: value}`, in --help order."""
        return {
            k: v for name in SECTIONS for k, v in dataclasses.asdict(getattr(self, name)).items()
        }

    def to_yaml(self) -> str:
        skip = {"config", "print_config", "overwrite"}  # actions of one launch, not settings
        return yaml.safe_dump(
            {k: list(v) if isinstance(v, tuple) else v for k, v in self.to_dict().items()
             if k not in skip},
            sort_keys=False,
        )  # fmt: skip


SECTIONS: dict[str, type] = {f.name: f.default_factory for f in fields(Config)}  # type: ignore[misc]
_SECTION_FLAGS = {name: [f.name for f in fields(cls)] for name, cls in SECTIONS.items()}
FIELDS = {f.name: f for cls in SECTIONS.values() for f in fields(cls)}
