"""The built-in networks by name: `--model=auto|mlp|conv|resnet` and a VAE's bottleneck."""

from __future__ import annotations

import torch
from torch import nn

from ae.config import ModelConfig
from ae.data.decoding.decode import InputSpec
from ae.training.models import ModelError
from ae.training.models.conv import conv_autoencoder
from ae.training.models.mlp import mlp_autoencoder
from ae.training.models.resnet import resnet_autoencoder


def resolve_name(model: str, spec: InputSpec) -> str:
    """`auto` -> `mlp` for vectors, `conv` for images; anything else as given."""
    if model == "auto":
        return "mlp" if spec.kind == "vector" else "conv"
    return model


def builtin_networks(spec: InputSpec, cfg: ModelConfig) -> tuple[nn.Module, nn.Module]:
    """Encoder and decoder of a built-in model. A VAE's encoder outputs twice the latent
    channels (mean, log-variance); the decoder takes the latent itself."""
    name = resolve_name(cfg.model, spec)
    factor = 2 if cfg.kl_weight > 0 else 1
    wanted = "vector" if name == "mlp" else "image"
    if spec.kind != wanted:
        shape = "x".join(map(str, spec.shape))
        raise ModelError(
            f"model: {name} needs {wanted} samples; these are {spec.kind}s of {shape} (use "
            f"{'mlp' if spec.kind == 'vector' else 'conv or resnet'}, or auto)"
        )
    if name == "mlp":
        widths = cfg.hidden_dims or (cfg.hidden_dim, cfg.hidden_dim // 2)
        return mlp_autoencoder(spec.shape[0], widths, cfg.latent_dim, factor * cfg.latent_dim)
    if name == "conv":
        return conv_autoencoder(spec.shape, cfg.hidden_dim, cfg.latent_dim, factor * cfg.latent_dim)
    _, h, w = spec.shape
    f = cfg.downsample
    if h % f or w % f:
        # --image_size=N makes every image N x N, whatever its native size: name the nearest
        lo = min(h, w) // f * f
        sizes = " or ".join(f"--image_size={n}" for n in (lo, lo + f) if n > 0)
        raise ModelError(
            f"downsample: {h}x{w} images cannot be reduced by {f} (H and W must be multiples "
            f"of it): {sizes}, or a smaller --downsample"
        )
    return resnet_autoencoder(
        spec.shape,
        downsample=f,
        base_channels=cfg.base_channels,
        channel_mult=cfg.channel_mult,
        res_blocks=cfg.res_blocks,
        latent_channels=cfg.latent_channels,
        latent_out=factor * cfg.latent_channels,
    )


def kl_divergence(mean: torch.Tensor, logvar: torch.Tensor) -> torch.Tensor:
    """KL(N(mean, var) || N(0, 1)), averaged over latent elements (as the reconstruction loss is
    over input elements, so `--kl_weight` does not depend on the latent's size)."""
    return 0.5 * (mean.pow(2) + logvar.exp() - 1.0 - logvar).mean()
