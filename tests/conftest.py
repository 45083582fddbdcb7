"""Fixtures: tiny real shards, running the real launcher as a subprocess, a real SLURM."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from ae.data.shards.writer import write_shard
from bench.real_images import mixed_collection
from tests.support import slurm as slurm_support
from tests.support.runs import RunResult, run_launcher
from tests.support.shards import image_samples, vector_samples


@pytest.fixture
def make_shards(tmp_path: Path) -> Callable[..., str]:
    """make_shards([10, 10, 3], kind="npy", name="train") -> brace spec of the written shards.
    Sample keys are globally unique and consecutive across the shards."""

    def make(sizes: list[int], kind: str = "npy", name: str = "train", dim: int = 16) -> str:
        out = tmp_path / "shards"
        start = 0
        for i, n in enumerate(sizes):
            samples = vector_samples(n, dim, start) if kind == "npy" else image_samples(n, 8, start)
            write_shard(out / f"{name}-{i:06d}.tar", samples)
            start += n
        return str(out / f"{name}-{{000000..{len(sizes) - 1:06d}}}.tar")

    return make


@pytest.fixture
def launch(tmp_path: Path) -> Callable[..., RunResult]:
    def run(args: list[str], env: dict[str, str] | None = None, timeout: float = 240) -> RunResult:
        return run_launcher(args, tmp_path / "run", env, timeout)

    return run


@pytest.fixture(scope="session")
def slurm() -> Iterator[None]:
    """A SLURM that answers: the one here, or the one-node cluster of
    tests/support/slurm_cluster.sh, started for the session (and stopped after it). Tests that
    use it are skipped, with the reason, where neither works (no root for apt-get, no network)."""
    started = False
    if not slurm_support.sinfo_answers():
        if (why := slurm_support.start_cluster()) is not None:
            pytest.skip(f"no SLURM cluster: {why}")
        started = True
    yield
    if started:
        slurm_support.stop_cluster()


@pytest.fixture(scope="session")
def real_photos(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    """35 real photographs of many sizes (17x23 .. 1411x1411), modes (L, LA, RGB, RGBA, P, CMYK,
    I;16) and formats (PNG, JPEG, WebP, GIF): scikit-image's 20 photos, from its pinned wheel
    (downloaded once into a per-user cache), plus variants of them (`bench.real_images`)."""
    return mixed_collection(tmp_path_factory.mktemp("photos"))
