"""The custom ops of the engines ppcompile targets, known by their registered names without a declaration.

An engine's model forward calls its own ops (vLLM's CPU build runs every linear as ``_C::onednn_mm``);
without this table each would be an unknown op, so a padding-unsafe break, and a user would have to
discover and declare them. Each entry names the op as registered (``"namespace::name"``) and its role:

- ``TOKEN_LOCAL``: row i of its outputs depends only on row i of its inputs (linears, norms, activations,
  rotary embeddings by position, per-token quantisation). It stays in graph segments.
- ``ATTENTION``: an attention break. Its ``layer_arg`` names the argument that carries the layer: an int,
  or a module path such as ``"model.layers.7.self_attn.attn"`` whose one integer component is the global
  layer id (vLLM passes it as a string constant, or on torch >= 2.11 as a ``LayerName`` object that
  Dynamo makes a graph input: its traced value is read).
- ``STATE_WRITE``: writes state outside its outputs through the engine's forward context (the KV cache,
  a state-space layer's conv and SSM states) while its schema declares no mutation, so no analysis can
  see the write. Always a break, run on the live rows only: on padded rows it would write padding into
  the cache. It cannot be declared token-local (``token_local_ops``, ``register_token_local_op``).
- ``ALL_REDUCE``: an engine collective that combines row i of every rank's input into row i (as the
  ``collective_ops`` option declares one).

Nothing is imported: an entry applies once its engine has registered the op in the process. A
declaration by the user (``split_ops``, ``token_local_ops``, ``collective_ops``) still applies on top.
Ops an engine registers under a generic namespace (vLLM's ``_C``) are matched by name: another library
registering an op of the same name there would be taken for the engine's.

Before (a vLLM CPU decoder layer, no options)::

    _C.onednn_mm(out, x, None, handle)          # unknown op: a padding-unsafe break
    _C.rotary_embedding(positions, q, k, ...)   # unknown op: a break
    vllm.unified_kv_cache_update(k, v, "model.layers.0.self_attn.attn")  # unknown op: a break

After: the linear and the rotary stay in graphs; the cache write and the attention op beside it are one
break (``split_at_breaks`` merges adjacent breaks) at global layer 0.
"""

from __future__ import annotations

import dataclasses
import enum
import re
from typing import Any

from ppcompile.torch_internals.ops import qualified_op_name

__all__ = ["ENGINE_OPS", "EngineOp", "OpRole", "engine_op", "layer_from_name", "names_with_role",
           "refuse_token_local"]


class OpRole(str, enum.Enum):
    """What a known engine op does to token rows and to state."""

    TOKEN_LOCAL = "token-local"
    ATTENTION = "attention"
    STATE_WRITE = "state write"
    ALL_REDUCE = "all-reduce"


@dataclasses.dataclass(frozen=True)
class EngineOp:
    """One known op: its role, the engine that registers it, and for attention the layer argument."""

    role: OpRole
    engine: str
    layer_arg: str | None = None
    writes: str = ""  # for STATE_WRITE: what it writes, for messages


def _entries(role: OpRole, engine: str, names: str, **fields: str) -> dict[str, EngineOp]:
    return {name: EngineOp(role, engine, **fields) for name in names.split()}


_VLLM_TOKEN_LOCAL = """
    _C::onednn_mm _C::onednn_scaled_mm _C::cutlass_scaled_mm
    _C::rms_norm _C::fused_add_rms_norm _C::poly_norm
    _C::rms_norm_static_fp8_quant _C::fused_add_rms_norm_static_fp8_quant
    _C::rms_norm_dynamic_per_token_quant
    _C::silu_and_mul _C::mul_and_silu _C::gelu_and_mul _C::gelu_tanh_and_mul _C::fatrelu_and_mul
    _C::swigluoai_and_mul _C::gelu_new _C::gelu_fast _C::gelu_quick _C::gelu_tanh
    _C::rotary_embedding
    _C::static_scaled_fp8_quant _C::dynamic_per_token_scaled_fp8_quant
    _C::static_scaled_int8_quant _C::dynamic_scaled_int8_quant
    _moe_C::topk_softmax
"""
_SGLANG_TOKEN_LOCAL = """
    sgl_kernel::rmsnorm sgl_kernel::fused_add_rmsnorm sgl_kernel::gemma_rmsnorm
    sgl_kernel::gemma_fused_add_rmsnorm sgl_kernel::silu_and_mul sgl_kernel::gelu_and_mul
    sgl_kernel::gelu_tanh_and_mul sgl_kernel::apply_rope_pos_ids_cos_sin_cache
"""

ENGINE_OPS: dict[str, EngineOp] = {
    **_entries(OpRole.TOKEN_LOCAL, "vLLM", _VLLM_TOKEN_LOCAL),
    **_entries(OpRole.TOKEN_LOCAL, "SGLang", _SGLANG_TOKEN_LOCAL),
    # vLLM 0.32's names (its own list of attention ops for piecewise graphs, and its KV-cache writers).
    **_entries(OpRole.ATTENTION, "vLLM",
               "vllm::unified_attention vllm::unified_attention_with_output "
               "vllm::unified_mla_attention_with_output", layer_arg="layer_name"),
    **_entries(OpRole.STATE_WRITE, "vLLM",
               "vllm::unified_kv_cache_update vllm::unified_mla_kv_cache_update "
               "vllm::fused_rope_and_unified_kv_cache_update vllm::fused_rope_unified_mla_kv_cache_update "
               "vllm::fused_qk_norm_rope_and_unified_kv_cache_update "
               "vllm::fused_qk_norm_mrope_and_unified_kv_cache_update",
               layer_arg="layer_name", writes="the layer's KV cache"),
    **_entries(OpRole.STATE_WRITE, "vLLM",
               "vllm::mamba_mixer vllm::mamba_mixer2 vllm::short_conv vllm::linear_attention "
               "vllm::qwen_gdn_attention_core vllm::qwen_gdn_attention_core_fused_norm_packed "
               "vllm::cpu_gdn_attention_core vllm::gdn_attention_core_xpu vllm::olmo_hybrid_gdn_full_forward",
               layer_arg="layer_name", writes="the layer's conv and SSM states"),
    **_entries(OpRole.ALL_REDUCE, "vLLM", "vllm::all_reduce"),
    **_entries(OpRole.ALL_REDUCE, "SGLang", "sglang::inplace_all_reduce sglang::outplace_all_reduce"),
}
"""Known engine ops by registered name (see the module docstring)."""


def engine_op(qualified_name: str) -> EngineOp | None:
    """The entry of an op by its registered name (``"_C::onednn_mm"``), or None."""
    return ENGINE_OPS.get(qualified_name)


def names_with_role(role: OpRole) -> list[str]:
    """Registered names of the known ops with ``role``."""
    return [name for name, op in ENGINE_OPS.items() if op.role is role]


_INTEGER = re.compile(r"(?:^|\.)(\d+)(?=\.|$)")


def layer_from_name(value: Any) -> int | None:
    """The global layer id an attention op's layer argument carries: an int as is, a module path (or an
    object holding one as ``value``) by its one integer component (``"model.layers.7.self_attn.attn"``
    -> 7); None when there is none or several."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if not isinstance(value, str):
        value = getattr(value, "value", None)  # a name wrapped in an object (vLLM's LayerName)
    if not isinstance(value, str):
        return None
    found = _INTEGER.findall(value)
    return int(found[0]) if len(found) == 1 else None


def refuse_token_local(op: Any) -> None:
    """Raises ``ValueError`` if ``op`` (``"ns::name"``, a packet or an overload) is a known op that writes
    state through a context, declared token-local: declared so, it would run inside graph segments on
    padded rows and write padding into the state."""
    qualified_name = op if isinstance(op, str) else qualified_op_name(op) or ""
    entry = ENGINE_OPS.get(qualified_name)
    if entry is not None and entry.role is OpRole.STATE_WRITE:
        raise ValueError(
            f"pp_breakable: {qualified_name} cannot be token-local: it writes {entry.writes} through "
            f"{entry.engine}'s forward context (its schema declares no mutation), so inside a graph it "
            "would write padded rows too. ppcompile already runs it as a break on the live rows; nothing "
            "needs declaring. An op of your own that does the same belongs in the split_ops option."
        )
