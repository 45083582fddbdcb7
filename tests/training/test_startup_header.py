"""The rank header never stops a rank: `ae` run from a source checkout has no package metadata."""

from __future__ import annotations

import importlib.metadata

import pytest

from ae.training import startup_header


def test_version_of_a_source_checkout_is_named_not_raised(monkeypatch: pytest.MonkeyPatch) -> None:
    assert startup_header.ae_version() == importlib.metadata.version("ae")  # installed here

    def no_metadata(name: str) -> str:
        raise importlib.metadata.PackageNotFoundError(name)

    # What a checkout on PYTHONPATH without `pip install` sees (found on a GPU node).
    monkeypatch.setattr(importlib.metadata, "version", no_metadata)
    assert startup_header.ae_version() == "source"
