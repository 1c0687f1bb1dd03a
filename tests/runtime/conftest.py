"""Fixtures of the runtime tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from mixer_runtime import seen_rows


@pytest.fixture
def interpret(monkeypatch: pytest.MonkeyPatch, tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Triton's interpreter on (fused copiers run on CPU tensors), kernel sources in a temporary cache
    dir; skipped without Triton."""
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv("PPCOMPILE_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "ppcompile-cache"))
    yield


@pytest.fixture
def fresh_mixer(fresh_dynamo: None) -> Iterator[None]:
    """For the mixer stage's tests (``mixer_runtime.py``): fresh Dynamo and counters (tests/conftest.py),
    no rows seen yet, no autograd."""
    seen_rows.clear()
    with torch.no_grad():
        yield
