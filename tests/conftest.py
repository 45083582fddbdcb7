"""Fixtures: tiny real shards, running the real launcher as a subprocess, a real SLURM."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from bench.real_images import mixed_collection
from tests.support import slurm as slurm_support
from tests.support.runs import RunResult, run_launcher
from tests.support.shards import write_test_shards

# The slowest tests of each run, written to .pytest_durations.txt (printed by .ci/run).
pytest_plugins = ["tests.support.durations"]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Under pytest-xdist (./run_tests.sh), the long tests first: a worker that draws one at the
    end keeps the others idle until it is done. First each xdist_group (its tests run one after
    another on one worker), then the other slow tests, then the rest, each in collection order.
    Every worker sorts alike, as xdist requires; a plain `pytest` keeps collection order."""
    if not hasattr(config, "workerinput"):
        return

    def rank(item: pytest.Item) -> int:
        if item.get_closest_marker("xdist_group") is not None:
            return 0
        return 1 if item.get_closest_marker("slow") is not None else 2

    items.sort(key=rank)


@pytest.fixture
def make_shards(tmp_path: Path) -> Callable[..., str]:
    """make_shards([10, 10, 3], kind="npy", name="train") -> brace spec of the written shards.
    Sample keys are globally unique and consecutive across the shards."""

    def make(sizes: list[int], kind: str = "npy", name: str = "train", dim: int = 16) -> str:
        return write_test_shards(tmp_path / "shards", sizes, kind, name, dim)

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
