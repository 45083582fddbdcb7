"""Fixtures: tiny real shards, running the real launcher as a subprocess, a real SLURM, the
records logged meanwhile."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from loguru import logger

from bench.real_images import mixed_collection
from tests.support import slurm as slurm_support
from tests.support.runs import RunResult, run_launcher
from tests.support.shards import write_test_shards

_GROUP_LOST = pytest.StashKey[bool]()

# Every test of each run, slowest first, written to .pytest_durations.txt (.ci/run prints its head).
pytest_plugins = ["tests.support.durations"]


@pytest.hookimpl(trylast=True)  # after pytest-xdist's own, which names each test's group
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Under pytest-xdist (./run_tests.sh), the long tests first: a worker that draws one at the
    end keeps the others idle until it is done. The groups come first anyway (xdist hands
    out the largest group first), then the other slow tests, then the rest, in collection order.
    Every worker sorts alike, as xdist requires; a plain `pytest` keeps collection order.

    And where pytest drops the groups (pytest 9.2 ignores the group that xdist 3.8 writes into
    each test's node id: pytest-xdist issue 1386), the grouped tests fail, saying so, instead of
    running side by side and failing in ways that would not say why."""
    if not hasattr(config, "workerinput"):
        return
    if config.getvalue("loadgroup"):
        for item in items:
            if item.get_closest_marker("xdist_group") and "@" not in item.nodeid:
                item.stash[_GROUP_LOST] = True

    def rank(item: pytest.Item) -> int:
        if item.get_closest_marker("xdist_group") is not None:
            return 0
        return 1 if item.get_closest_marker("slow") is not None else 2

    items.sort(key=rank)


def pytest_runtest_setup(item: pytest.Item) -> None:
    if item.stash.get(_GROUP_LOST, False):
        pytest.fail(
            f"pytest {pytest.__version__} drops xdist_group (pytest-xdist issue 1386): this "
            "grouped test would run beside others; install the dev extra's pytest "
            "(./run_tests.sh does)",
            pytrace=False,
        )


@pytest.fixture
def records() -> Iterator[list[tuple[str, str]]]:
    """(level, message) of every loguru record logged meanwhile, in order."""
    out: list[tuple[str, str]] = []
    sink = logger.add(lambda m: out.append((m.record["level"].name, m.record["message"])))
    yield out
    logger.remove(sink)


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
