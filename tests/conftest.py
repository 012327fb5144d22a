"""The suite uses hookfit's own pytest plugin, as a plugin author's suite would."""

from __future__ import annotations

import pytest

pytest.register_assert_rewrite("hookfit.testing")

from hookfit.testing import Recorder, spec_arguments  # noqa: E402

pytest_plugins = ["hookfit.testing"]

spec_names = spec_arguments  # the name the tests use

__all__ = ["Recorder", "spec_names"]


@pytest.fixture
def recorder(hookfit_recorder: Recorder) -> Recorder:
    return hookfit_recorder


@pytest.fixture(autouse=True)
def _isolated(hookfit_isolated: None) -> None:
    """Tests choose their plugins explicitly; a test that wants the discovered ones unsets
    HOOKFIT_PLUGINS itself."""
