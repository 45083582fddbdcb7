"""Fixtures of the launcher's tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from loguru import logger


@pytest.fixture
def said() -> Iterator[list[str]]:
    """What the launcher logs (its console)."""
    lines: list[str] = []
    handle = logger.add(lambda m: lines.append(m.record["message"]), format="{message}")
    yield lines
    logger.remove(handle)
