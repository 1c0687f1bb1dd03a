"""A one-linear stage for tests of what wraps a stage graph (the backend's registry, fall-offs)."""

from __future__ import annotations

from typing import Any

import torch

import ppcompile

__all__ = ["H", "Tiny", "call"]

H = 8


class Tiny(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(H, H)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.lin(x))


def call(compiled: Any, n: int, mark: bool | None = None) -> torch.Tensor:
    """``compiled`` on ``n`` random tokens under ``no_grad``; the token dim is marked dynamic when
    ``mark`` (default: for more than one token, as a 1-token call is traced static anyway)."""
    x = torch.randn(n, H)
    if n > 1 if mark is None else mark:
        ppcompile.mark_token_dynamic(x)
    with torch.no_grad():
        out: torch.Tensor = compiled(x)
    return out
