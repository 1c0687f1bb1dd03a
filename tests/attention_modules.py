"""Tiny modules around the reference attention op, for the FX pass tests."""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import AbstractContextManager

import torch

import ppcompile.models  # noqa: F401  (registers torch.ops.ppcompile.attention)
from ppcompile.models import ModelConfig, make_forward_context, set_forward_context

__all__ = ["CFG", "Attn", "attention_context"]

CFG = ModelConfig(hidden_size=8, num_heads=2, num_kv_heads=2, head_dim=4, num_layers=8)


def attention_context(num_tokens: int, layer_ids: Sequence[int]) -> AbstractContextManager[object]:
    """A forward context with one sequence of ``num_tokens`` and KV caches for ``layer_ids``."""
    return set_forward_context(make_forward_context([num_tokens], CFG, layer_ids))


class Attn(torch.nn.Module):
    """``x [T, 8]`` -> per layer: linear, attention at a global layer id, residual add -> relu."""

    def __init__(self, layer_ids: Sequence[int]) -> None:
        super().__init__()
        self.layer_ids = tuple(layer_ids)
        self.lins = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in self.layer_ids)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x
        for layer_id, lin in zip(self.layer_ids, self.lins):
            q = lin(h).view(-1, 2, 4)
            h = torch.ops.ppcompile.attention(q, q, q, layer_id).reshape(-1, 8) + h
        return torch.relu(h)
