"""Shared fixtures of the test suite."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

import ppcompile


@pytest.fixture(autouse=True)
def _reset_counters() -> Iterator[None]:
    """Every test starts and ends with ``ppcompile.counters`` at zero."""
    ppcompile.counters.reset()
    yield
    ppcompile.counters.reset()


@pytest.fixture
def fresh_dynamo() -> Iterator[None]:
    """Dynamo's caches empty before and after the test: compiles of one test never leak into another."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.fixture(scope="module")
def one_thread() -> Iterator[None]:
    """Tiny models: one intra-op thread is faster and immune to oversubscription on a shared CPU."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
