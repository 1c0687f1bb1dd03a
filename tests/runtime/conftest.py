"""Fixtures of the runtime tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest


@pytest.fixture
def interpret(monkeypatch: pytest.MonkeyPatch, tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Triton's interpreter on (fused copiers run on CPU tensors), kernel sources in a temporary cache
    dir; skipped without Triton."""
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv("PPCOMPILE_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "ppcompile-cache"))
    yield
