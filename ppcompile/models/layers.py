"""Building blocks of the reference packed-token decoder (activations are ``[T, hidden]``).

Everything here traces with Dynamo under ``fullgraph=True, dynamic=True``: no branching on tensor values
or on the token count, no ``.item()``, no data-dependent shapes (the MoE evaluates every expert densely).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import ppcompile.models.attention  # noqa: F401  (registers torch.ops.ppcompile.attention)
from ppcompile.analysis.token_locality import register_token_local_op
from ppcompile.models.config import ModelConfig
from ppcompile.models.paged_attention import PagedMetadata
from ppcompile.models.tensor_parallel import NO_TP, TensorParallel

__all__ = ["MLP", "Attention", "DecoderLayer", "MoE", "PPMissingLayer", "RMSNorm", "RotaryEmbedding"]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``x`` normalised by its root mean square over the last dim (in float32), times ``weight``."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return xf.to(x.dtype) * weight


@torch.library.custom_op("ppcompile::fused_add_rms_norm", mutates_args=("x", "residual"))
def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> None:
    """vLLM's ``fused_add_rms_norm`` in torch ops: ``residual += x``, then ``x = rms_norm(residual) *
    weight``, both in place. Row-local, so registered token-local: it stays in graphs, also where it writes
    what the stage received (``pp_breakable`` copies those writes back into the caller's tensors)."""
    residual.add_(x)
    x.copy_(rms_norm(residual, weight, eps))


@fused_add_rms_norm.register_fake
def _fused_add_rms_norm_fake(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> None:
    return None


register_token_local_op("ppcompile::fused_add_rms_norm")


class RMSNorm(nn.Module):
    """RMSNorm; ``forward(x, residual)`` first adds ``residual`` and returns ``(normed, x + residual)``
    (``in_place``: :func:`fused_add_rms_norm` writes both into ``x`` and ``residual`` and returns them)."""

    def __init__(self, hidden_size: int, eps: float, in_place: bool = False) -> None:
        super().__init__()
        self.eps = eps
        self.in_place = in_place
        self.weight = nn.Parameter(torch.ones(hidden_size))

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            return self._norm(x)
        if self.in_place:
            fused_add_rms_norm(x, residual, self.weight, self.eps)
            return x, residual
        residual = x + residual
        return self._norm(residual), residual


class RotaryEmbedding(nn.Module):
    """Neox-style rotary embedding over a ``cos_sin_cache`` buffer ``[max_position, head_dim]``."""

    cos_sin_cache: torch.Tensor

    def __init__(self, head_dim: int, max_position: int, theta: float) -> None:
        super().__init__()
        self.head_dim = head_dim
        inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
        freqs = torch.outer(torch.arange(max_position, dtype=torch.float64), inv_freq)
        cache = torch.cat([freqs.cos(), freqs.sin()], dim=-1).to(torch.float32)
        self.register_buffer("cos_sin_cache", cache, persistent=False)

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x1, x2 = x.float().chunk(2, dim=-1)
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``positions``: int64 ``[T]``; ``q``: ``[T, Hq, D]``; ``k``: ``[T, Hkv, D]``."""
        cos, sin = self.cos_sin_cache[positions].chunk(2, dim=-1)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        return self._rotate(q, cos, sin), self._rotate(k, cos, sin)


class Attention(nn.Module):
    """GQA self-attention whose core is the opaque ``torch.ops.ppcompile.attention`` op. With ``tp``, this
    rank's ``1 / tp.size`` of the heads; the output projection's partial sums are all-reduced.

    With ``cfg.paged_attention`` the core is the capturable ``torch.ops.ppcompile.paged_attention`` over the
    layer's own paged cache (the non-persistent buffer ``kv_cache``), its metadata passed as
    ``attn_metadata``."""

    kv_cache: torch.Tensor

    def __init__(self, cfg: ModelConfig, layer_id: int, tp: TensorParallel = NO_TP) -> None:
        super().__init__()
        self.layer_id = int(layer_id)  # GLOBAL layer id, a python int constant in the graph
        self.with_output = cfg.attention_with_output
        self.paged = cfg.paged_attention
        self.block_size = cfg.block_size
        self.tp = tp
        self.num_heads = tp.part(cfg.num_heads)
        self.num_kv_heads = tp.part(cfg.num_kv_heads)
        self.head_dim = cfg.head_dim
        self.q_size = self.num_heads * cfg.head_dim
        self.kv_size = self.num_kv_heads * cfg.head_dim
        self.qkv_proj = nn.Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=False)
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=False)
        self.rotary_emb = RotaryEmbedding(cfg.head_dim, cfg.max_position, cfg.rope_theta)
        if self.paged:
            cache = torch.zeros(cfg.kv_blocks * cfg.block_size, 2, self.num_kv_heads, cfg.head_dim,
                                dtype=cfg.dtype)
            self.register_buffer("kv_cache", cache, persistent=False)

    def qkv(
        self, positions: torch.Tensor, hidden: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Rotated ``q [T, Hq, D]``, ``k [T, Hkv, D]`` and contiguous ``v [T, Hkv, D]``."""
        q, k, v = self.qkv_proj(hidden).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.reshape(-1, self.num_heads, self.head_dim)
        k = k.reshape(-1, self.num_kv_heads, self.head_dim)
        v = v.reshape(-1, self.num_kv_heads, self.head_dim)
        q, k = self.rotary_emb(positions, q, k)
        return q, k, v.contiguous()

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               attn_metadata: PagedMetadata | None = None) -> torch.Tensor:
        """The attention op itself, for this layer's global id: ``[T, Hq * D]`` (written into a tensor
        allocated here with ``cfg.attention_with_output``; the paged op reads ``attn_metadata``)."""
        if self.paged:
            if attn_metadata is None:
                raise ValueError(f"Attention (layer {self.layer_id}): cfg.paged_attention needs "
                                 "attn_metadata (a models.paged_attention.PagedMetadata), got None")
            m = attn_metadata
            out = torch.ops.ppcompile.paged_attention(q, k, v, self.kv_cache, m.query_start_loc, m.seq_lens,
                                                      m.block_table, m.slot_mapping, self.layer_id,
                                                      self.block_size)
        elif self.with_output:
            out = torch.empty_like(q)
            torch.ops.ppcompile.attention_with_output(q, k, v, out, self.layer_id)
        else:
            out = torch.ops.ppcompile.attention(q, k, v, self.layer_id)
        return out.reshape(-1, self.q_size)

    def project(self, out: torch.Tensor) -> torch.Tensor:
        """The output projection of the attention op's ``out`` (summed over the TP group)."""
        return self.tp.all_reduce(self.o_proj(out))

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor,
                attn_metadata: PagedMetadata | None = None) -> torch.Tensor:
        return self.project(self.attend(*self.qkv(positions, hidden), attn_metadata))


class MLP(nn.Module):
    """SwiGLU MLP: ``down(silu(gate) * up)``. With ``tp``, this rank's ``1 / tp.size`` of the intermediate
    features; the down projection's partial sums are all-reduced unless ``reduce`` is False (the caller
    sums them, as :class:`MoE` does once for all its experts)."""

    def __init__(self, hidden_size: int, intermediate_size: int, tp: TensorParallel = NO_TP,
                 reduce: bool = True) -> None:
        super().__init__()
        self.tp = tp
        self.reduce = reduce
        self.gate_up_proj = nn.Linear(hidden_size, 2 * tp.part(intermediate_size), bias=False)
        self.down_proj = nn.Linear(tp.part(intermediate_size), hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        out = self.down_proj(F.silu(gate) * up)
        return self.tp.all_reduce(out) if self.reduce else out


class MoE(nn.Module):
    """Top-k routed mixture of SwiGLU experts, evaluated densely so every shape is static.

    Each expert runs on all tokens; a ``[T, E]`` weight matrix (renormalised top-k softmax probabilities
    scattered into zeros) mixes their outputs. With ``tp`` every expert is sharded like :class:`MLP` and
    the mixed partial sums are all-reduced once.
    """

    def __init__(self, cfg: ModelConfig, tp: TensorParallel = NO_TP) -> None:
        super().__init__()
        self.tp = tp
        self.top_k = cfg.experts_top_k
        self.gate = nn.Linear(cfg.hidden_size, cfg.num_experts, bias=False)
        self.experts = nn.ModuleList(
            MLP(cfg.hidden_size, cfg.moe_intermediate_size, tp, reduce=False) for _ in range(cfg.num_experts)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        probs = torch.softmax(self.gate(x).float(), dim=-1)
        top_w, top_i = torch.topk(probs, self.top_k, dim=-1)
        top_w = top_w / top_w.sum(dim=-1, keepdim=True)
        weights = torch.zeros_like(probs).scatter(1, top_i, top_w).to(x.dtype)  # [T, E]
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            out = out + weights[:, e : e + 1] * expert(x)
        return self.tp.all_reduce(out)


def nested_region(fn: Any) -> Any:
    """``torch.compiler.nested_compile_region(fn)`` where torch has it (Dynamo traces ``fn`` once and
    reuses the trace for every layer), else ``fn``. A no-op outside ``torch.compile``."""
    region = getattr(torch.compiler, "nested_compile_region", None)
    return region(fn) if region is not None else fn


# The attention-free halves of a decoder layer, as nested compile regions (cfg.compile_regions). They
# hold no layer id (a constant that differs per layer would defeat reuse) and return no view of an
# input (regions may not alias). Each is the layer's own code, only regrouped.
@nested_region
def _before_attention(
    layer: DecoderLayer, positions: torch.Tensor, hidden: torch.Tensor, residual: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    hidden, residual = layer.input_layernorm(hidden, residual)
    return (*layer.self_attn.qkv(positions, hidden), residual)


@nested_region
def _after_attention(
    layer: DecoderLayer, out: torch.Tensor, residual: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    hidden, residual = layer.post_attention_layernorm(layer.self_attn.project(out), residual)
    return layer.mlp(hidden), residual


@nested_region
def _before_attention_hidden_only(
    layer: DecoderLayer, positions: torch.Tensor, hidden: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return layer.self_attn.qkv(positions, layer.input_layernorm(hidden))


@nested_region
def _after_attention_hidden_only(
    layer: DecoderLayer, hidden: torch.Tensor, out: torch.Tensor
) -> torch.Tensor:
    hidden = hidden + layer.self_attn.project(out)
    return hidden + layer.mlp(layer.post_attention_layernorm(hidden))


class DecoderLayer(nn.Module):
    """One pre-norm decoder layer for GLOBAL layer ``layer_id``.

    Fused-residual mode: ``forward(positions, hidden, residual) -> (hidden, residual)`` (``residual=None``
    only for global layer 0, which then starts the residual stream). Hidden-only mode
    (``cfg.hidden_only``): ``forward(positions, hidden) -> hidden`` with plain residual adds.
    """

    def __init__(self, cfg: ModelConfig, layer_id: int, tp: TensorParallel = NO_TP) -> None:
        super().__init__()
        self.layer_id = int(layer_id)
        self.hidden_only = cfg.hidden_only
        self.compile_regions = cfg.compile_regions
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_eps, cfg.in_place_norm)
        self.self_attn = Attention(cfg, layer_id, tp)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_eps, cfg.in_place_norm)
        self.mlp: nn.Module = (MoE(cfg, tp) if cfg.num_experts
                               else MLP(cfg.hidden_size, cfg.intermediate_size, tp))

    def forward(
        self, positions: torch.Tensor, hidden: torch.Tensor, residual: torch.Tensor | None = None,
        attn_metadata: PagedMetadata | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if self.compile_regions and self.hidden_only:
            out = self.self_attn.attend(*_before_attention_hidden_only(self, positions, hidden))
            return _after_attention_hidden_only(self, hidden, out)
        if self.compile_regions and residual is not None:
            q, k, v, residual = _before_attention(self, positions, hidden, residual)
            return _after_attention(self, self.self_attn.attend(q, k, v), residual)
        if self.hidden_only:
            hidden = hidden + self.self_attn(positions, self.input_layernorm(hidden), attn_metadata)
            return hidden + self.mlp(self.post_attention_layernorm(hidden))
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(positions, hidden, attn_metadata)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class PPMissingLayer(nn.Module):
    """Placeholder for a layer owned by another PP stage; keeps ``layers[i]`` at global numbering."""

    def forward(self, *args: object, **kwargs: object) -> None:
        raise RuntimeError(
            "PPMissingLayer was called: this layer belongs to another pipeline stage; "
            "run only layers[start_layer:end_layer]"
        )
