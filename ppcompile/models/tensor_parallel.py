"""Tensor parallelism for the reference decoder: which rank holds which shard, and its collectives.

A TP stage splits each layer the way Megatron-style engines do: the QKV and gate/up projections are
column-parallel (each rank holds ``1 / size`` of the heads and of the intermediate features), the attention
output and down projections are row-parallel (each rank computes a partial sum, then one all-reduce per
projection), the embedding is vocab-parallel (each rank looks up the ids in its vocabulary range, zero rows
elsewhere, then an all-reduce) and so is ``lm_head`` (each rank computes its vocabulary columns, then an
all-gather along the vocabulary dim). Norms, the rotary cache, the MoE router and ``topk_embed`` are
replicated.

The collectives are ``torch.distributed`` calls that Dynamo traces to ``_c10d_functional`` ops, so
``pp_breakable`` keeps them in graph segments; outside ``torch.compile`` they run eagerly.
:func:`shard_state_dict` cuts a full stage's weights into one rank's shards, which is how
``make_stage(..., tp=...)`` gives every TP size the weights of the same full model.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

from ppcompile.models.config import ModelConfig

__all__ = ["NO_TP", "TensorParallel", "shard_state_dict"]


@dataclasses.dataclass(frozen=True)
class TensorParallel:
    """Rank ``rank`` of a TP group of ``size`` ranks (``group``: its process group; None for one rank)."""

    rank: int = 0
    size: int = 1
    group: Any = None

    def __post_init__(self) -> None:
        if isinstance(self.size, bool) or not isinstance(self.size, int) or self.size < 1:
            raise ValueError(f"TensorParallel.size must be a positive int, got {self.size!r}")
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or not 0 <= self.rank < self.size:
            raise ValueError(f"TensorParallel.rank must be in [0, {self.size}), got {self.rank!r}")
        if self.size > 1 and self.group is None:
            raise ValueError(f"TensorParallel of {self.size} ranks needs its process group (group=...)")

    @classmethod
    def of(cls, group: Any) -> TensorParallel:
        """This process's place in ``group`` (an initialised ``torch.distributed`` process group)."""
        return cls(dist.get_rank(group), dist.get_world_size(group), group)

    def check(self, cfg: ModelConfig) -> None:
        """Raises ``ValueError`` unless every sharded size of ``cfg`` divides by ``size``."""
        sizes = {"num_heads": cfg.num_heads, "num_kv_heads": cfg.num_kv_heads, "vocab_size": cfg.vocab_size,
                 "intermediate_size": cfg.intermediate_size}
        if cfg.num_experts:
            sizes["moe_intermediate_size"] = cfg.moe_intermediate_size
        bad = {name: value for name, value in sizes.items() if value % self.size}
        if bad:
            raise ValueError(f"tensor parallelism over {self.size} ranks shards {sorted(sizes)}; these "
                             f"do not divide by {self.size}: {bad}")

    def part(self, total: int) -> int:
        """This rank's share of ``total`` (which divides by ``size``)."""
        return total // self.size

    def rows(self, total: int, offset: int = 0) -> slice:
        """This rank's shard of ``total`` consecutive rows starting at ``offset``."""
        part = self.part(total)
        return slice(offset + self.rank * part, offset + (self.rank + 1) * part)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sums ``x`` over the group, in place (as engines call it); ``x`` itself with one rank."""
        if self.size > 1:
            dist.all_reduce(x, group=self.group)
        return x

    def gather_last_dim(self, x: torch.Tensor) -> torch.Tensor:
        """The ranks' ``x`` side by side along the last dim (rank order); ``x`` itself with one rank."""
        if self.size == 1:
            return x
        # Gathered along dim 0, then chunk + cat: torch 2.11's gather to another dim calls a helper
        # Dynamo will not trace (a graph break); this is the round trip pp_breakable keeps in graphs.
        stacked = funcol.wait_tensor(_all_gather(x, 0, self.group))
        return torch.cat(torch.chunk(stacked, self.size, dim=0), dim=-1)


NO_TP = TensorParallel()
# torch 2.13 renamed all_gather_tensor (which now warns) to all_gather_single; both trace alike.
_all_gather = getattr(funcol, "all_gather_single", None) or funcol.all_gather_tensor


def _qkv_rows(cfg: ModelConfig, tp: TensorParallel) -> list[slice]:
    """The rows of a full ``qkv_proj`` weight (``[q | k | v]``) that rank ``tp.rank`` holds, by block."""
    q_size, kv_size = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    return [tp.rows(q_size), tp.rows(kv_size, q_size), tp.rows(kv_size, q_size + kv_size)]


def _shard(name: str, full: torch.Tensor, cfg: ModelConfig, tp: TensorParallel) -> torch.Tensor:
    """Rank ``tp.rank``'s shard of the full parameter ``name`` (replicated ones whole)."""
    leaf = name.rsplit(".", 2)[-2] if name.count(".") else name
    if leaf == "qkv_proj":
        return torch.cat([full[rows] for rows in _qkv_rows(cfg, tp)])
    if leaf == "gate_up_proj":  # [gate | up], each column-parallel
        half = full.shape[0] // 2
        return torch.cat([full[tp.rows(half)], full[tp.rows(half, half)]])
    if leaf in ("o_proj", "down_proj"):  # row-parallel: the input features
        return full[:, tp.rows(full.shape[1])]
    if leaf in ("embed_tokens", "lm_head"):  # vocab-parallel
        return full[tp.rows(full.shape[0])]
    return full


def shard_state_dict(full: Mapping[str, torch.Tensor], cfg: ModelConfig,
                     tp: TensorParallel) -> dict[str, torch.Tensor]:
    """A full stage's state dict cut into rank ``tp.rank``'s shards (the names do not change)."""
    tp.check(cfg)
    return {name: _shard(name, t, cfg, tp).clone() for name, t in full.items()}
