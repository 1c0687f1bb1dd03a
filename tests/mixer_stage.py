"""The two-segment test stage several suites share: graph (up) | break (a mixer op) | graph (down).

The mixer's output rows depend on every live row (causal mean plus the mean over all rows), so a break
that saw padding, or a graph that read a stale buffer, gives a visibly different answer. Each suite
registers its own mixer op (custom op names are process-wide) with :func:`register_mixer`, choosing
what the op does first on each call (record the row count, run a test's hook).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

__all__ = ["MixerStage", "mix_rows", "register_mixer"]


def mix_rows(x: torch.Tensor) -> torch.Tensor:
    """Causal mean plus the mean over all rows of ``x [T, H]``."""
    count = torch.arange(1, x.shape[0] + 1, dtype=x.dtype, device=x.device)[:, None]
    return x.cumsum(0) / count + x.mean(0, keepdim=True)


def register_mixer(name: str, before: Callable[[torch.Tensor], None]) -> Any:
    """Registers the custom op ``name`` (``"namespace::op"``) computing :func:`mix_rows` after
    ``before(x)``; returns the op."""

    @torch.library.custom_op(name, mutates_args=())
    def mixer(x: torch.Tensor) -> torch.Tensor:
        before(x)
        return mix_rows(x)

    @mixer.register_fake
    def _(x: torch.Tensor) -> torch.Tensor:
        return torch.empty_like(x)

    return mixer


class MixerStage(nn.Module):
    """graph (up) | break (``op``) | graph (down); inputs ``x``, ``residual`` of width ``width``;
    outputs ``out`` and ``out + residual``. Weights are seeded."""

    def __init__(self, op: Callable[[torch.Tensor], torch.Tensor], width: int = 8, seed: int = 0) -> None:
        super().__init__()
        self.op = op
        g = torch.Generator().manual_seed(seed)
        self.up = nn.Linear(width, 2 * width)
        self.down = nn.Linear(2 * width, width)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.op(torch.relu(self.up(x + residual)))
        out = self.down(h)
        return out, out + residual
