"""The networks `--model` chooses: `mlp`, `conv`, `resnet` (built in), or a class of your own.

- `mlp`: vectors (`.npy` samples) -> a bottleneck vector of `--latent_dim` (`mlp.py`);
- `conv`: small images -> a bottleneck vector of `--latent_dim`, the demo's net (`conv.py`);
- `resnet`: images -> a spatial latent of `--latent_channels` x H/f x W/f (`resnet.py`);
- `package.module:ClassName`: yours, imported by path (`user.py`).

`ae.training.model` wraps any of them in the LightningModule that trains them. The launcher's
check of a user class, which imports nothing, is `ae.config.model_path`.
"""

from __future__ import annotations

from ae.errors import UserError


class ModelError(UserError):
    """A model that cannot be built from the flags and the data: one message naming the flag."""
