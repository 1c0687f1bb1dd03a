"""Fixtures of the reliability tests: a fresh Dynamo, no fault hook, one intra-op thread."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from reliability_helpers import HOOK


@pytest.fixture(autouse=True)
def _fresh() -> Iterator[None]:
    torch._dynamo.reset()
    HOOK["fn"] = None
    yield
    HOOK["fn"] = None
    torch._dynamo.reset()


@pytest.fixture(scope="module", autouse=True)
def _one_thread(one_thread: None) -> None:
    """Every test here runs with tests/conftest.py's ``one_thread``."""
