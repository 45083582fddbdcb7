"""Two sample specs (32x32 RGB images, vectors of 24) and `build`: the model and latent shape
that --model and its flags build for them, on one rank."""

from __future__ import annotations

from ae.config import ModelConfig, OptimConfig
from ae.data.decoding.decode import InputSpec
from ae.training.model import AutoEncoder
from ae.training.model_build import build_model

IMAGE = InputSpec("image", (3, 32, 32))
VECTOR = InputSpec("vector", (24,))


def build(spec: InputSpec, **flags: object) -> tuple[AutoEncoder, tuple[int, ...] | None]:
    return build_model(spec, ModelConfig(**flags), OptimConfig(), world_size=1)
