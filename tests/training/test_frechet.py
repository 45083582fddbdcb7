"""rFID's arithmetic: the Frechet distance against hand computations, ~0 for identical sets,
moments from running sums, and the cross-rank reduction (sums summed) giving the distance of all
the vectors together, also through a real 2-process gloo group."""

from __future__ import annotations

import math

import pytest
import torch

from ae.training import frechet
from ae.training.frechet import FrechetDistance, frechet_distance, moments
from tests.support.forked_ranks import run_ranks


def test_diagonal_covariances_by_hand() -> None:
    # |mu1 - mu2|^2 = 1 + 4; per axis a + b - 2 sqrt(ab): 1 + 4 - 4 = 1, 4 + 9 - 12 = 1
    mu1, mu2 = torch.tensor([0.0, 0.0]), torch.tensor([1.0, 2.0])
    s1, s2 = torch.diag(torch.tensor([1.0, 4.0])), torch.diag(torch.tensor([4.0, 9.0]))
    assert frechet_distance(mu1, s1, mu2, s2) == pytest.approx(7.0, abs=1e-12)


def test_non_commuting_covariances_by_hand() -> None:
    # S1 S2 = [[2, 4], [1, 8]]: trace 10, determinant 12, so tr sqrt(S1 S2) = sqrt(10 + 2 sqrt 12)
    # and FID = tr S1 + tr S2 - 2 sqrt(10 + 4 sqrt 3) = 4 + 5 - 2 sqrt(10 + 4 sqrt 3)
    s1 = torch.tensor([[2.0, 1.0], [1.0, 2.0]])
    s2 = torch.diag(torch.tensor([1.0, 4.0]))
    mu = torch.zeros(2)
    expected = 9 - 2 * math.sqrt(10 + 4 * math.sqrt(3))
    assert frechet_distance(mu, s1, mu, s2) == pytest.approx(expected, abs=1e-12)
    assert frechet_distance(mu, s2, mu, s1) == pytest.approx(expected, abs=1e-12)  # symmetric
    # against the identity: tr sqrt(S1) = sqrt 3 + 1
    assert frechet_distance(mu, s1, mu, torch.eye(2)) == pytest.approx(
        6 - 2 * (math.sqrt(3) + 1), abs=1e-12
    )


def test_identical_sets_are_zero_also_with_fewer_vectors_than_dimensions() -> None:
    g = torch.Generator().manual_seed(0)
    for n, d in ((500, 16), (40, 64)):  # the second: a singular covariance, as a small val set
        x = torch.rand(n, d, generator=g).double()
        mu, cov = moments(x.sum(0), x.T @ x, n)
        # Not exactly 0 with a singular covariance: the square roots of its zero eigenvalues,
        # rounding at 1e-17, are 1e-8 each (FIDs are read to 0.01).
        assert abs(frechet_distance(mu, cov, mu, cov)) < 1e-6
        m = FrechetDistance(d)
        m.update(x, x)
        assert abs(float(m.compute())) < 1e-6
        m.update(x[:1] + 1, x[:1])  # one vector differs: no longer 0
        assert float(m.compute()) > 1e-3


def test_moments_from_sums_are_torch_cov() -> None:
    x = torch.randn(37, 5, dtype=torch.float64) + 3
    mean, cov = moments(x.sum(0), x.T @ x, 37)
    torch.testing.assert_close(mean, x.mean(0))
    torch.testing.assert_close(cov, torch.cov(x.T))  # unbiased (n - 1), as pytorch-fid's np.cov


def _gaussian_sets(n: int = 300, d: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    real = torch.randn(n, d, generator=g)
    fake = torch.randn(n, d, generator=g) @ torch.diag(torch.linspace(0.5, 2, d)) + 0.3
    return real, fake


def _direct(real: torch.Tensor, fake: torch.Tensor) -> float:
    r, f = real.double(), fake.double()
    return frechet_distance(r.mean(0), torch.cov(r.T), f.mean(0), torch.cov(f.T))


def test_batches_and_rank_sums_add_up_to_the_whole_set() -> None:
    real, fake = _gaussian_sets()
    expected = _direct(real, fake)
    assert expected > 0.5  # different distributions: a distance that the checks below can miss
    whole = FrechetDistance(8)
    for i in range(0, 300, 64):  # uneven batches
        whole.update(real[i : i + 64], fake[i : i + 64])
    assert float(whole.compute()) == pytest.approx(expected, rel=1e-9)
    # two "ranks" with unequal shares, reduced as torchmetrics reduces them across ranks
    rank0, rank1 = FrechetDistance(8), FrechetDistance(8)
    rank0.update(real[:100], fake[:100])
    rank1.update(real[100:], fake[100:])
    assert float(rank1.compute()) != pytest.approx(expected, rel=1e-3)  # one rank's share alone
    rank0.merge_state(rank1)
    assert float(rank0.compute()) == pytest.approx(expected, rel=1e-9)


def test_the_real_sides_decomposition_is_kept_while_its_sums_stay_the_same(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Validation after validation over the same images: the real side's eigen-decomposition is
    done once, and each distance is still the one computed from scratch; other real images (to
    the last bit of their sums) are decomposed again."""
    real, fake = _gaussian_sets()
    shifts = (0.0, 0.5, 1.0)  # the reconstructions change, the validation images do not
    expected = [_direct(real, fake + shift) for shift in shifts] + [_direct(real[:-1], fake)]
    factored = []
    sqrt_factor = frechet.sqrt_factor
    monkeypatch.setattr(frechet, "sqrt_factor", lambda s: factored.append(1) or sqrt_factor(s))
    m = FrechetDistance(8)
    for shift, want in zip(shifts, expected, strict=False):
        m.update(real, fake + shift)
        assert float(m.compute()) == pytest.approx(want, rel=1e-9)
        m.reset()  # as Lightning resets it after each validation
    assert len(factored) == 1
    m.update(real[:-1], fake)  # one image fewer
    assert float(m.compute()) == pytest.approx(expected[-1], rel=1e-9)
    assert len(factored) == 2


def test_fewer_than_two_vectors_is_nan() -> None:
    m = FrechetDistance(4)
    m.update(torch.rand(1, 4), torch.rand(1, 4))
    assert math.isnan(float(m.compute()))


def test_a_decomposition_that_fails_is_nan_not_a_crash(monkeypatch: pytest.MonkeyPatch) -> None:
    def diverges(*_: torch.Tensor) -> torch.Tensor:
        raise torch.linalg.LinAlgError("linalg.eigh: The algorithm failed to converge")

    monkeypatch.setattr("ae.training.frechet.sqrt_factor", diverges)
    m = FrechetDistance(4)
    m.update(torch.rand(8, 4), torch.rand(8, 4))
    assert math.isnan(float(m.compute()))


# Each rank updates with its own share of the same two sets; compute() must sync the sums over
# the gloo group (torchmetrics' own path, as Lightning's epoch-end compute takes it), and only
# rank 0 computes the distance (seconds of eigen-decomposition), which the others receive.
def _rank_fid(rank: int) -> dict:
    calls = []
    distance = frechet.frechet_distance
    # the rank is a forked process of its own: this patch is its alone
    frechet.frechet_distance = lambda *a, **k: calls.append(1) or distance(*a, **k)
    real, fake = _gaussian_sets()
    share = slice(0, 120) if rank == 0 else slice(120, None)
    m = FrechetDistance(8)
    m.update(real[share], fake[share])
    return {"fid": float(m.compute()), "computed": len(calls)}


@pytest.mark.slow
def test_two_gloo_ranks_compute_the_distance_of_all_vectors() -> None:
    ranks = run_ranks(_rank_fid)
    expected = _direct(*_gaussian_sets())
    for rank in (0, 1):
        got = ranks[rank]
        assert got["fid"] == pytest.approx(expected, rel=1e-9), rank
        assert got["computed"] == (1 if rank == 0 else 0), rank
