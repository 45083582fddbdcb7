"""User models with the classic multi-GPU bug: a collective that only rank 1 calls, once
(`--model=tests.support.desync_models:SmallExtraCollective`, or `:BucketExtraCollective`). Used
by tests/e2e/test_collectives.py."""

import torch
import torch.distributed as dist

from tests.support.my_autoencoder import TinyAutoEncoder

AT_CALL = 4  # the loss() call (training step) on rank 1 that adds the collective


class SmallExtraCollective(TinyAutoEncoder):
    """Rank 1 all-reduces 3 numbers the others never send: gloo aborts it (size mismatch)."""

    def extra_size(self) -> int:
        return 3

    def loss(self, x):
        self.calls = getattr(self, "calls", 0) + 1
        if self.calls == AT_CALL and dist.is_initialized() and dist.get_rank() == 1:
            dist.all_reduce(torch.zeros(self.extra_size()))  # the bug: rank 1 only
        return super().loss(x)


class BucketExtraCollective(SmallExtraCollective):
    """Rank 1 all-reduces a tensor the size of the gradient bucket: it pairs with the others'
    gradient all-reduce, then the job hangs."""

    def extra_size(self) -> int:
        return sum(p.numel() for p in self.parameters())
