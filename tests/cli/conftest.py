"""Fixtures of the ``ppcompile.cli`` tests: one intra-op thread, Dynamo reset around each test."""

from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def _isolated(fresh_dynamo: None, one_thread: None) -> None:
    """Every command test: fresh Dynamo caches, one intra-op thread (fixtures in tests/conftest.py)."""
