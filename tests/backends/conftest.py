"""Fixtures of the segment-compiler tests: one Inductor cache for the session, fresh Dynamo per test."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
import torch
from torch._inductor.runtime.cache_dir_utils import default_cache_dir

from ppcompile.backends.segment_compilers import clear_segment_cache


@pytest.fixture(scope="session", autouse=True)
def _inductor_cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """One fresh Inductor cache for the whole session, as on a CI machine (unless the caller chose a
    cache): the cold cache costs its CPU vector-ISA probe and header builds once, at the first Inductor
    compile of the session, not per test."""
    # Importing torch._dynamo already set the variable to Inductor's default: that is not a choice.
    chosen = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    with pytest.MonkeyPatch.context() as mp:
        if not chosen or os.path.abspath(chosen) == os.path.abspath(default_cache_dir()):
            mp.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path_factory.mktemp("inductor_cache")))
        yield


@pytest.fixture(scope="module", autouse=True)
def _one_thread(one_thread: None) -> None:
    """Every test here runs with tests/conftest.py's ``one_thread``."""


@pytest.fixture(autouse=True)
def _fresh_compiles() -> Iterator[None]:
    """Each test starts with no Dynamo cache and no shared segment artifacts."""
    torch._dynamo.reset()
    clear_segment_cache()
    yield
    torch._dynamo.reset()
    clear_segment_cache()
