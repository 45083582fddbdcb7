"""rFID: the Frechet distance between the FID Inception features of the validation images and of
their reconstructions (`val/rfid`, with `--fid_weights`).

    FID = |mu_r - mu_f|^2 + tr(S_r) + tr(S_f) - 2 tr((S_r S_f)^(1/2))

with mu and S the mean and the (unbiased, n - 1) covariance of each set's 2048-d features, as
pytorch-fid computes them. FID needs the statistics of every validation image, all ranks'
together: each rank keeps running sums (of the features, of their outer products, the count; in
float64, 2048 x 2048 of them per set), torchmetrics sums them across ranks when the epoch's value
is computed (validation's end: nothing per training step), and the distance comes from the sums.
Memory stays constant however long the validation set is. The distance itself is computed on
rank 0 alone and broadcast: its 2048 x 2048 eigen-decomposition costs seconds of CPU (~9 s on one
thread), the same on every rank for the same synced sums. That of the validation images, the
same at every validation, is kept from one to the next.

The matrix square root without scipy: tr((S_r S_f)^(1/2)) is the sum of the square roots of the
eigenvalues of S_r S_f, which are those of the symmetric A S_f A with A = S_r^(1/2) (AB and BA
have the same eigenvalues): symmetric eigen-decompositions in float64, whose eigenvalues are
real, clamped at 0 where rounding makes a zero one negative.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from loguru import logger
from torchmetrics import Metric

from ae.training.inception import FEATURES


def moments(total: torch.Tensor, outer: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(mean, unbiased covariance) of n vectors from their sum and the sum of their outer
    products: S = (sum x x^T - n mu mu^T) / (n - 1)."""
    mean = total / n
    return mean, (outer - n * torch.outer(mean, mean)) / (n - 1)


def sqrt_factor(sigma: torch.Tensor) -> torch.Tensor:
    """V D^(1/2) over the non-zero directions of the covariance sigma = V D V^T, in float64: the
    eigen-decomposition `frechet_distance` needs of its first covariance (the costly part)."""
    sigma = sigma.double()
    values, vectors = torch.linalg.eigh(sigma)
    # Below this, an eigenvalue is rounding of a zero one (float64, relative to the largest).
    keep = values > values.abs().max() * sigma.shape[0] * torch.finfo(torch.float64).eps
    return vectors[:, keep] * values[keep].sqrt()


def frechet_distance(
    mu1: torch.Tensor,
    sigma1: torch.Tensor,
    mu2: torch.Tensor,
    sigma2: torch.Tensor,
    factor1: torch.Tensor | None = None,
) -> float:
    """The Frechet distance between the Gaussians N(mu1, sigma1) and N(mu2, sigma2), in float64;
    `factor1`: `sqrt_factor(sigma1)` when it is known already.

    With sigma1 = V D V^T, A = V D^(1/2) V^T and A sigma2 A = V (D^(1/2) V^T sigma2 V D^(1/2))
    V^T: the eigenvalues wanted are those of the inner matrix, whose rows and columns for a zero
    eigenvalue of sigma1 are zero. Only sigma1's non-zero directions are kept, so a covariance of
    n < 2048 images (rank n - 1) costs an n x n problem after its eigen-decomposition."""
    mu1, sigma1, mu2, sigma2 = (t.double() for t in (mu1, sigma1, mu2, sigma2))
    scaled = sqrt_factor(sigma1) if factor1 is None else factor1
    inner = scaled.T @ sigma2 @ scaled
    inner = (inner + inner.T) / 2  # symmetric to the last bit, as eigh assumes
    trace_sqrt = torch.linalg.eigvalsh(inner).clamp_min(0).sqrt().sum()
    diff = mu1 - mu2
    return float(diff @ diff + sigma1.trace() + sigma2.trace() - 2 * trace_sqrt)


class FrechetDistance(Metric):
    """The Frechet distance between two sets of feature vectors given batch by batch (`real`,
    `fake`), over every rank: the states are sums, summed across ranks at `compute`. NaN while
    either set has fewer than 2 vectors (no covariance)."""

    full_state_update = False
    higher_is_better = False

    def __init__(self, features: int = FEATURES) -> None:
        super().__init__()
        # The real side's synced sums at the last distance, and their `sqrt_factor`: the
        # validation images are the same at every validation of a run (its own shards, or the
        # hold-out that a resume keeps), so their eigen-decomposition, over half the distance's
        # cost (all of it but an n x n problem for n < 2048 images), is done again only when
        # the sums differ to the last bit (another order of batches may round them otherwise).
        self._real_factor: tuple[list[torch.Tensor], torch.Tensor] | None = None
        for side in ("real", "fake"):
            self.add_state(f"{side}_sum", torch.zeros(features, dtype=torch.float64), "sum")
            self.add_state(
                f"{side}_outer", torch.zeros(features, features, dtype=torch.float64), "sum"
            )
            self.add_state(f"{side}_n", torch.zeros((), dtype=torch.float64), "sum")

    def update(self, real: torch.Tensor, fake: torch.Tensor) -> None:
        for side, x in (("real", real), ("fake", fake)):
            x = x.double()
            setattr(self, f"{side}_sum", getattr(self, f"{side}_sum") + x.sum(0))
            setattr(self, f"{side}_outer", getattr(self, f"{side}_outer") + x.T @ x)
            setattr(self, f"{side}_n", getattr(self, f"{side}_n") + x.shape[0])

    def compute(self) -> torch.Tensor:
        """The distance of the synced sums. Synced (torchmetrics syncs the sums before this, as
        `sync_on_compute` and `distributed_available_fn` say: every rank is here, holding the same
        sums), rank 0 computes it and broadcasts it; otherwise this process computes it."""
        synced = self.sync_on_compute and bool(self.distributed_available_fn())
        if not synced or dist.get_rank(self.process_group) == 0:
            value = torch.tensor(self._distance(), dtype=torch.float64, device=self.real_sum.device)
        else:
            value = torch.empty((), dtype=torch.float64, device=self.real_sum.device)
        if synced:
            dist.broadcast(value, dist.get_global_rank(self.process_group or dist.group.WORLD, 0),
                           group=self.process_group)  # fmt: skip
        return value

    def _distance(self) -> float:
        n_real, n_fake = int(self.real_n), int(self.fake_n)
        if min(n_real, n_fake) < 2:
            return float("nan")
        real = moments(self.real_sum, self.real_outer, n_real)
        fake = moments(self.fake_sum, self.fake_outer, n_fake)
        try:
            sums = [self.real_sum, self.real_outer, self.real_n]
            known = self._real_factor
            if known is None or not all(map(torch.equal, known[0], sums)):
                known = self._real_factor = ([t.clone() for t in sums], sqrt_factor(real[1]))
            return frechet_distance(*real, *fake, factor1=known[1])
        except torch.linalg.LinAlgError as e:  # an eigen-decomposition that did not converge
            logger.warning(f"val/rfid: no value this validation ({e})")
            return float("nan")
