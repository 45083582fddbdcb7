"""The validation schedule's guard on the private Lightning hook it overrides (its behaviour is
pinned end to end in tests/e2e/test_recipe.py)."""

from __future__ import annotations

from types import SimpleNamespace

import lightning
import pytest

from ae.training.val_schedule import check_lightning


def test_validation_schedule_refuses_an_unchecked_lightning() -> None:
    """The schedule overrides a private Lightning hook: a version outside the checked range, or
    a loop without the hook, stops the run at setup with a message naming both."""
    loop = SimpleNamespace(_should_check_val_fx=None, _should_accumulate=None)
    check_lightning("2.6.6", loop)  # checked: no error
    with pytest.raises(RuntimeError, match=r"Lightning 2\.4\.\.2\.6; this is Lightning 2\.7\.0"):
        check_lightning("2.7.0", loop)
    with pytest.raises(RuntimeError, match="without _should_check_val_fx"):
        check_lightning("2.5.1", SimpleNamespace(_should_accumulate=None))
    assert lightning.__version__.startswith(("2.4", "2.5", "2.6"))  # what pyproject installs
