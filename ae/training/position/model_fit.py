"""Whether a checkpoint can be resumed with this run's flags: settings that shape the model or its
input cannot carry over, and are refused before training with one message comparing them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from ae.errors import UserError
from ae.training.position.checkpoint_read import spec_from_record

# Flags whose change gives the model other weights: named when the weights do not fit.
SHAPE_KEYS = (
    "model", "model_args", "hidden_dim", "hidden_dims", "latent_dim", "latent_channels",
    "base_channels", "channel_mult", "res_blocks", "downsample", "channels",
)  # fmt: skip
# Flags that give the model another input: refused even where the weights fit (a fully
# convolutional model takes any image size), when both runs named one and they differ (left
# unset, ae picked one from the data, which the checkpoint does not say).
INPUT_KEYS = ("input_key", "image_size")


class ResumeRefused(UserError):
    """The checkpoint's model cannot be trained on with these flags."""


def _shape(t: torch.Tensor) -> str:
    return "x".join(map(str, t.shape)) or "scalar"


def _samples(record: Any) -> str | None:
    """`vectors of 16`, `images of 3x32x32`: the input a model's hyper-parameters record."""
    spec = spec_from_record(record)
    if spec is None:
        return None
    return f"{spec.kind}s of {'x'.join(map(str, spec.shape))}"


def incompatible(
    saved: dict[str, Any],
    now: dict[str, Any],
    weights: dict[str, Any],
    model: nn.Module,
    built: tuple[dict[str, Any], dict[str, Any]] = ({}, {}),
) -> list[str]:
    """`key: checkpoint value -> flag value` for each setting that cannot carry over: another
    input, or weights that do not fit the model (named by the flags that changed them, else by
    the first weights that differ; a VAE toggle counts only where its shapes differ). `built`:
    the hyper-parameters the checkpoint's model and this one recorded, where they have them: the
    samples each was built for, and the built-in model `auto` resolved to."""
    saved_hp, now_hp = built
    # `--model=auto` and the name it resolves to (mlp for vectors) build the same model.
    same_model = "model" in saved_hp and saved_hp["model"] == now_hp.get("model")

    def shown(k: str, value: Any, hp: dict[str, Any]) -> str:
        # `model: 'auto' -> 'resnet'` left the checkpoint's model unsaid: `'auto' (conv)`
        built_as = hp.get("model") if k == "model" else None
        return f"{value!r}" + (f" ({built_as})" if built_as and built_as != value else "")

    changed = [
        f"{k}: {shown(k, saved[k], saved_hp)} -> {shown(k, now[k], now_hp)}"
        for k in SHAPE_KEYS
        if k in saved and k in now and saved[k] != now[k] and not (k == "model" and same_model)
    ]
    inputs = [
        f"{k}: {saved[k]!r} -> {now[k]!r}"
        for k in INPUT_KEYS
        if saved.get(k) and now.get(k) and saved[k] != now[k]
    ]
    mine = model.state_dict()
    misfits = [
        f"{k}: {_shape(v)} -> {_shape(mine[k])}"
        for k, v in weights.items()
        if torch.is_tensor(v) and k in mine and v.shape != mine[k].shape
    ]
    missing = sorted(set(mine) - set(weights)) + sorted(set(weights) - set(mine))
    if not misfits and not missing:
        return inputs
    if (saved.get("kl_weight", 0) > 0) != (now.get("kl_weight", 0) > 0):
        changed.append(f"kl_weight: {saved.get('kl_weight')!r} -> {now.get('kl_weight')!r}")
    if (saved.get("disc_weight", 0) > 0) != (now.get("disc_weight", 0) > 0):
        changed.append(
            f"disc_weight: {saved.get('disc_weight', 0.0)!r} -> {now.get('disc_weight')!r} (a "
            "discriminator cannot be added to or dropped from a run on resume: its optimizer "
            "state has no such group; keep --disc_weight, and --disc_start to delay it)"
        )
    changed += inputs
    before, after = _samples(saved_hp.get("spec")), _samples(now_hp.get("spec"))
    if before and after and before != after:  # the data, not a flag: said first
        changed.insert(0, f"input: {before} -> {after} (the samples these flags read)")
    if not changed:  # the flags agree, the data does not (another image size, field, ...)
        changed = misfits[:3] or [f"weights: {', '.join(missing[:3])} differ"]
    return changed


def check_resume(path: Path, ckpt: dict[str, Any], now: dict[str, Any], model: nn.Module) -> None:
    """Raise `ResumeRefused` (exit 2, one message) if checkpoint `ckpt` (read from `path` by
    `checkpoint_read`) cannot be resumed with `now`."""
    saved_hp = ckpt.get("hyper_parameters")
    now_hp = getattr(model, "hparams", None)
    built = (
        dict(saved_hp) if isinstance(saved_hp, dict) else {},
        dict(now_hp) if isinstance(now_hp, dict) else {},
    )
    problems = incompatible(
        ckpt.get("ae_config", {}), now, ckpt.get("state_dict", {}), model, built
    )
    if problems:
        raise ResumeRefused(
            f"resume_from_checkpoint: {path} holds another model than these flags build "
            "(checkpoint -> flags):\n"
            + "\n".join(f"  {p}" for p in problems)
            + "\nResume with the checkpoint's settings and data, or start a new run in another"
            " --output_dir."
        )
