"""Shared fixtures of the test suite."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

import ppcompile


@pytest.fixture(autouse=True)
def _reset_counters() -> Iterator[None]:
    """Every test starts and ends with ``ppcompile.counters`` at zero."""
    ppcompile.counters.reset()
    yield
    ppcompile.counters.reset()
