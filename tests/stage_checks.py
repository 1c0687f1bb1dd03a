"""One comparison of a stage's outputs with eager's, shared by the test folders: a logits tensor or a
proxies mapping (every key; float tensors within ``atol``, integer tensors exactly)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

__all__ = ["ATOL", "assert_close"]

ATOL = 1e-5


def assert_close(got: Any, want: Any, what: str, atol: float = ATOL) -> None:
    """Compares a logits tensor or a proxies mapping (every key; integer tensors exactly)."""
    if isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor), f"{what}: got {type(got).__name__}, expected a tensor"
        assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)} != {tuple(want.shape)}"
        if want.is_floating_point():
            torch.testing.assert_close(got, want, atol=atol, rtol=0, msg=lambda m: f"{what}: {m}")
        else:
            assert torch.equal(got, want), f"{what}: integer tensors differ"
        return
    assert isinstance(got, Mapping) and isinstance(want, Mapping), f"{what}: {type(got)} vs {type(want)}"
    assert sorted(got) == sorted(want), f"{what}: keys {sorted(got)} != {sorted(want)}"
    for key in want:
        assert_close(got[key], want[key], f"{what}[{key}]", atol)
