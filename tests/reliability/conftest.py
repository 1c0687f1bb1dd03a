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
def _one_thread() -> Iterator[None]:
    """Tiny stages: one intra-op thread is faster and immune to oversubscription on a shared CPU."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
