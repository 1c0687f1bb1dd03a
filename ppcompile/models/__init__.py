"""Reference PP-stage models: a packed-token Llama/Qwen-style decoder whose attention is an opaque
custom op (``torch.ops.ppcompile.attention``) indexed by global layer id."""

from __future__ import annotations

from ppcompile.models.attention import (
    ForwardContext,
    get_forward_context,
    make_forward_context,
    set_forward_context,
)
from ppcompile.models.config import REFERENCE_CONFIGS, ModelConfig
from ppcompile.models.stage import PPStage, get_pp_indices, make_batch, make_stage
from ppcompile.models.tensor_parallel import TensorParallel

__all__ = [
    "REFERENCE_CONFIGS",
    "ForwardContext",
    "ModelConfig",
    "PPStage",
    "TensorParallel",
    "get_forward_context",
    "get_pp_indices",
    "make_batch",
    "make_forward_context",
    "make_stage",
    "set_forward_context",
]
