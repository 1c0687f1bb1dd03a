"""Shared fixtures of the test suite."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
import torch._inductor.config

import ppcompile

# The strict CUDA-capture double (tests/cuda_double.py) as the ``strict_cuda`` fixture.
pytest_plugins = ["cuda_double"]


@pytest.fixture(autouse=True)
def _reset_counters() -> Iterator[None]:
    """Every test starts and ends with ``ppcompile.counters`` at zero."""
    ppcompile.counters.reset()
    yield
    ppcompile.counters.reset()


@pytest.fixture(autouse=True)
def _restore_dynamo_config() -> Iterator[None]:
    """Every test ends with ``torch._dynamo.config`` and ``torch._inductor.config`` as it began: one
    test's settings never reach the next.

    One such leak is torch's own: on torch 2.11 a stage compiled with ``dynamic=True`` sets
    ``assume_static_by_default=False`` in the process-wide config when a call enters and puts back the
    value it saw when the call returns, without a lock. Two threads calling such stages at once
    (``tests/reliability/test_threads.py``) can leave it False for the rest of the process, and every later
    compile then passes each float module attribute (an RMSNorm ``eps``) as a graph input. torch 2.13 keeps
    these settings per thread (the race: pytorch/pytorch#118260).
    """
    configs = (torch._dynamo.config, torch._inductor.config)
    before = [config.get_config_copy() for config in configs]
    yield
    for config, saved in zip(configs, before):
        after = config.get_config_copy()
        for name, value in saved.items():
            if after[name] != value:
                setattr(config, name, value)


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
