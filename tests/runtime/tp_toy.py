"""A toy tensor-parallel stage for the TP runtime tests: per layer a column-parallel up projection, a
row-parallel down projection whose partial sums are all-reduced, and an attention break.

The all-reduce is one of four styles: ``"dist"`` (``torch.distributed.all_reduce``, in place, as
engines call it), ``"funcol"`` (``_functional_collectives.all_reduce``), ``"custom"`` and
``"custom_"`` (engine-style custom ops, out of place and in place, declared through the
``collective_ops`` option). Rank ``r`` of ``size`` holds shards of the same full weights, so any TP
size computes the same answer as ``ToyTP(size=1)``. At size 1 the all-reduce is left out unless
``force_collective`` (a one-rank group still calls it: the GPU test's one-rank NCCL stage).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from attention_modules import CFG, attention_context

__all__ = ["CUSTOM_OPS", "FAIL_AT", "STYLES", "ToyTP", "attention_context"]

STYLES = ("dist", "funcol", "custom", "custom_")
CUSTOM_OPS = ("pptest::tp_all_reduce", "pptest::tp_all_reduce_")
_GROUP: list[Any] = [None]  # the group the custom ops reduce over (set by ToyTP)
# A capture failure to inject: {"rank": r, "rows": b} makes the failing op raise on rank r for a tensor
# of b rows (a bucket no forward runs eagerly at).
FAIL_AT: dict[str, int] = {}


@torch.library.custom_op("pptest::tp_all_reduce", mutates_args=())
def tp_all_reduce(x: torch.Tensor) -> torch.Tensor:
    out = x.clone()
    dist.all_reduce(out, group=_GROUP[0])
    return out


@tp_all_reduce.register_fake
def _tp_all_reduce_fake(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


@torch.library.custom_op("pptest::tp_all_reduce_", mutates_args=("x",))
def tp_all_reduce_(x: torch.Tensor) -> None:
    dist.all_reduce(x, group=_GROUP[0])


@tp_all_reduce_.register_fake
def _tp_all_reduce_inplace_fake(x: torch.Tensor) -> None:
    return None


@torch.library.custom_op("pptest::fails_on_one_rank", mutates_args=())
def fails_on_one_rank(x: torch.Tensor) -> torch.Tensor:
    """``x + 0``, raising for the rank and row count ``FAIL_AT`` names (an injected capture failure)."""
    failing = FAIL_AT and dist.is_initialized() and dist.get_rank() == FAIL_AT["rank"]
    if failing and x.shape[0] == FAIL_AT["rows"]:
        raise RuntimeError(f"injected capture failure on rank {FAIL_AT['rank']} at {x.shape[0]} rows")
    return x + 0


@fails_on_one_rank.register_fake
def _fails_fake(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


def _full_weights(layers: int, hidden: int, ffn: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(7)
    return [(torch.randn(ffn, hidden, generator=gen) * hidden**-0.5,
             torch.randn(hidden, ffn, generator=gen) * ffn**-0.5) for _ in range(layers)]


class ToyTP(torch.nn.Module):
    """``x [T, 8]`` -> per layer: ``x + down(relu(up(x)))`` all-reduced, then attention at a global
    layer id; ``size`` ranks of ``group`` each hold ``ffn / size`` of the MLP."""

    def __init__(self, layer_ids: Sequence[int], style: str = "dist", size: int = 1, rank: int = 0,
                 group: Any = None, ffn: int = 16, inject: bool = False,
                 force_collective: bool = False) -> None:
        super().__init__()
        if style not in STYLES:
            raise ValueError(f"style must be one of {STYLES}, got {style!r}")
        self.layer_ids = tuple(layer_ids)
        self.style, self.size, self.group, self.inject = style, size, group, inject
        self.force_collective = force_collective
        _GROUP[0] = group
        shard = ffn // size
        self.ups = torch.nn.ParameterList()
        self.downs = torch.nn.ParameterList()
        rows = slice(rank * shard, (rank + 1) * shard)
        for up, down in _full_weights(len(self.layer_ids), CFG.hidden_size, ffn):
            self.ups.append(torch.nn.Parameter(up[rows].clone(), requires_grad=False))
            self.downs.append(torch.nn.Parameter(down[:, rows].clone(), requires_grad=False))

    def _all_reduce(self, y: torch.Tensor) -> torch.Tensor:
        if self.size == 1 and not self.force_collective:
            return y
        if self.style == "dist":
            dist.all_reduce(y, group=self.group)
            return y
        if self.style == "funcol":
            return funcol.all_reduce(y, "sum", self.group)
        if self.style == "custom":
            return torch.ops.pptest.tp_all_reduce(y)
        torch.ops.pptest.tp_all_reduce_(y)
        return y

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x
        for layer_id, up, down in zip(self.layer_ids, self.ups, self.downs):
            partial = torch.nn.functional.linear(torch.relu(torch.nn.functional.linear(h, up)), down)
            h = h + self._all_reduce(partial)
            if self.inject:
                h = torch.ops.pptest.fails_on_one_rank(h)
            q = h.view(-1, 2, 4)
            h = torch.ops.ppcompile.attention(q, q, q, layer_id).reshape(-1, 8) + h
        return h
