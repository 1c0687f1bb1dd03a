"""``ModelConfig``: the shape of the reference packed-token decoder, and a few named presets."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

__all__ = ["REFERENCE_CONFIGS", "ModelConfig"]


@dataclass(frozen=True)
class ModelConfig:
    """Shape and options of the reference decoder.

    ``num_experts=0`` selects a dense SwiGLU MLP, otherwise every layer is a dense-evaluated top-k MoE.
    ``hidden_only=True`` makes stages hand over only ``hidden_states`` (layers add their residual
    internally); otherwise stages hand over ``hidden_states`` and ``residual`` (fused-residual RMSNorm).
    ``topk_proxy>0`` adds an int32 ``topk_indices`` proxy of shape ``[T, topk_proxy]`` between stages.
    ``compile_regions=True`` marks the attention-free halves of each decoder layer as
    ``torch.compiler.nested_compile_region``s, so Dynamo traces them once per stage, not once per layer
    (compile with marked token dims: torch 2.13's regions fail under ``dynamic=True``).
    ``attention_with_output=True`` calls the out-variant ``ppcompile::attention_with_output`` (the layer
    allocates the output, the op writes it) instead of the functional ``ppcompile::attention``.
    ``in_place_norm=True`` makes the fused-residual RMSNorm the in-place ``ppcompile::fused_add_rms_norm``
    (vLLM's ``fused_add_rms_norm``: writes ``hidden`` and ``residual``); a non-first stage's first layer
    then writes the proxies it received. Needs the fused residual and no compile regions.
    ``paged_attention=True`` calls the capturable ``ppcompile::paged_attention`` (``models.paged_attention``)
    instead: each attention layer holds a paged KV cache buffer ``kv_cache`` of ``kv_blocks`` blocks of
    ``block_size`` slots, and the stage takes its metadata as ``attn_metadata`` (block tables of
    ``blocks_per_request`` columns). Excludes ``attention_with_output`` and ``compile_regions``.
    """

    vocab_size: int = 256
    hidden_size: int = 64
    intermediate_size: int = 128
    num_layers: int = 8
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 16
    rope_theta: float = 10000.0
    rms_eps: float = 1e-6
    max_position: int = 16384
    num_experts: int = 0
    experts_top_k: int = 2
    moe_intermediate_size: int = 64
    hidden_only: bool = False
    topk_proxy: int = 0
    compile_regions: bool = False
    attention_with_output: bool = False
    in_place_norm: bool = False
    dtype: torch.dtype = torch.float32
    seed: int = 0
    paged_attention: bool = False
    block_size: int = 4
    blocks_per_request: int = 8
    kv_blocks: int = 64

    def __post_init__(self) -> None:
        positive = ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                    "num_kv_heads", "head_dim", "max_position", "moe_intermediate_size", "block_size",
                    "blocks_per_request", "kv_blocks")
        for name in positive:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"ModelConfig.{name} must be a positive int, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"ModelConfig.num_heads ({self.num_heads}) must be a multiple of "
                f"num_kv_heads ({self.num_kv_heads}) for grouped-query attention"
            )
        if self.head_dim % 2:
            raise ValueError(f"ModelConfig.head_dim must be even for rotary embedding, got {self.head_dim}")
        if self.rope_theta <= 0 or self.rms_eps <= 0:
            raise ValueError(
                f"ModelConfig.rope_theta and rms_eps must be > 0, got {self.rope_theta} and {self.rms_eps}"
            )
        if self.num_experts < 0:
            raise ValueError(f"ModelConfig.num_experts must be >= 0 (0 = dense MLP), got {self.num_experts}")
        if self.num_experts and not 1 <= self.experts_top_k <= self.num_experts:
            raise ValueError(
                f"ModelConfig.experts_top_k must be in [1, num_experts={self.num_experts}], "
                f"got {self.experts_top_k}"
            )
        if not 0 <= self.topk_proxy <= self.hidden_size:
            raise ValueError(
                f"ModelConfig.topk_proxy must be in [0, hidden_size={self.hidden_size}], "
                f"got {self.topk_proxy}"
            )
        if self.in_place_norm and (self.hidden_only or self.compile_regions):
            raise ValueError("ModelConfig.in_place_norm needs the fused residual (hidden_only=False) and no "
                             "compile_regions (a nested region cannot write its inputs)")
        if self.paged_attention and (self.attention_with_output or self.compile_regions):
            raise ValueError("ModelConfig.paged_attention excludes attention_with_output and compile_regions "
                             "(the paged op returns its output and takes its metadata as arguments)")
        if not isinstance(self.dtype, torch.dtype) or not self.dtype.is_floating_point:
            raise ValueError(f"ModelConfig.dtype must be a floating torch.dtype, got {self.dtype!r}")

    def replace(self, **changes: object) -> ModelConfig:
        """A copy with ``changes`` applied (validated again)."""
        return dataclasses.replace(self, **changes)  # type: ignore[arg-type]


REFERENCE_CONFIGS: dict[str, ModelConfig] = {
    "tiny": ModelConfig(num_layers=4),
    "small-dense": ModelConfig(num_layers=8),
    "small-moe": ModelConfig(num_layers=8, num_experts=4, experts_top_k=2),
    "hidden-only": ModelConfig(num_layers=8, hidden_only=True),
    "topk": ModelConfig(num_layers=8, topk_proxy=4),
    "out-variant": ModelConfig(num_layers=8, attention_with_output=True),
    "in-place-norm": ModelConfig(num_layers=8, in_place_norm=True),
    "deep-dense": ModelConfig(num_layers=32),
}
