"""Reference PP-stage models: a packed-token Llama/Qwen-style decoder whose attention is an opaque
custom op (``torch.ops.ppcompile.attention``) indexed by global layer id, or, with
``ModelConfig.paged_attention``, the capturable ``torch.ops.ppcompile.paged_attention`` over paged KV
caches."""

from __future__ import annotations

from ppcompile.models.attention import (
    ForwardContext,
    get_forward_context,
    make_forward_context,
    set_forward_context,
)
from ppcompile.models.config import REFERENCE_CONFIGS, ModelConfig
from ppcompile.models.paged_attention import PagedMetadata, make_paged_metadata, paged_positions
from ppcompile.models.stage import PPStage, get_pp_indices, make_batch, make_paged_batch, make_stage
from ppcompile.models.tensor_parallel import TensorParallel

__all__ = [
    "REFERENCE_CONFIGS",
    "ForwardContext",
    "ModelConfig",
    "PPStage",
    "PagedMetadata",
    "TensorParallel",
    "get_forward_context",
    "get_pp_indices",
    "make_batch",
    "make_forward_context",
    "make_paged_batch",
    "make_paged_metadata",
    "make_stage",
    "paged_positions",
    "set_forward_context",
]
